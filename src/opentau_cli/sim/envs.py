"""The simulators `opentau eval --env` and `opentau dataset synth --env` drive, each behind one adapter: a seeded
reset, a step, and the observation under LeRobot's key names (docs/ARCHITECTURE.md, "Closed-loop evaluation").

The observation convention is LeRobot 0.4.4's env wrappers', so that a policy trained on LeRobot's data (or on ours)
sees the same inputs in either eval:
- MetaWorld: camera `corner2` (moved to (0.75, 0.075, 0.7) as LeRobot places it), the image flipped on both axes
  (MuJoCo renders that camera upside down and mirrored), under `observation.image`; state = the first 4 of the 39
  dims (hand xyz, gripper) under `observation.state`; the episode ends at the first success. `?state=full`
  (`metaworld:reach-v3?state=full`) gives the whole 39-d observation instead: it holds the object and goal
  positions, which at a small image size cover a pixel or two (docs/ARCHITECTURE.md, "Closed-loop evaluation").
- PushT: `pixels` -> `observation.image`, `agent_pos` -> `observation.state`.
- ALOHA: `pixels.top` -> `observation.images.top`, `agent_pos` -> `observation.state`.
Pixels stay uint8 (H, W, 3) here; `policy_inputs` gives what LeRobot's preprocessing is handed (float32 CHW in
[0, 1]).
"""

from __future__ import annotations

import ctypes.util
import os
from dataclasses import dataclass

import numpy as np

from opentau_cli.errors import UserError

SIM_EXTRA_FIX = "install the simulators with `pip install -e '.[sim]'` (scripts/setup_sim.sh)"
IMAGE_KEY = "observation.image"  # LeRobot's key of an env's single camera
STATE_KEY = "observation.state"
METAWORLD_CAMERA = "corner2"
METAWORLD_CAMERA_POSITION = (0.75, 0.075, 0.7)  # where LeRobot 0.4.4 places corner2
METAWORLD_STATE_DIMS = 4
METAWORLD_FULL_STATE_DIMS = 39
STATE_CHOICES = ("hand", "full")  # metaworld:TASK?state=...: LeRobot's first 4 dims (the default) or all 39
ALOHA_TASKS = {"transfer_cube": "gym_aloha/AlohaTransferCube-v0", "insertion": "gym_aloha/AlohaInsertion-v0"}
ALOHA_TEXT = {"transfer_cube": "Pick up the cube with the right arm and transfer it to the left arm.",
              "insertion": "Insert the peg into the socket."}
PUSHT_TEXT = "Push the T-shaped block onto the T-shaped target."
ENV_FPS = {"metaworld": 80, "pusht": 10, "aloha": 50}  # control rate: the videos' frame rate
ENV_FAMILIES = ("metaworld:TASK", "pusht", "aloha:transfer_cube", "aloha:insertion", "libero:SUITE")

# The instruction of each MetaWorld task, as LeRobot 0.4.4 pairs them (the prompt a policy trained on its data saw).
METAWORLD_TEXT = {
    "assembly-v3": "Pick up a nut and place it onto a peg",
    "basketball-v3": "Dunk the basketball into the basket",
    "bin-picking-v3": "Grasp the puck from one bin and place it into another bin",
    "box-close-v3": "Grasp the cover and close the box with it",
    "button-press-topdown-v3": "Press a button from the top",
    "button-press-topdown-wall-v3": "Bypass a wall and press a button from the top",
    "button-press-v3": "Press a button",
    "button-press-wall-v3": "Bypass a wall and press a button",
    "coffee-button-v3": "Push a button on the coffee machine",
    "coffee-pull-v3": "Pull a mug from a coffee machine",
    "coffee-push-v3": "Push a mug under a coffee machine",
    "dial-turn-v3": "Rotate a dial 180 degrees",
    "disassemble-v3": "Pick a nut out of a peg",
    "door-close-v3": "Close a door with a revolving joint",
    "door-lock-v3": "Lock the door by rotating the lock clockwise",
    "door-open-v3": "Open a door with a revolving joint",
    "door-unlock-v3": "Unlock the door by rotating the lock counter-clockwise",
    "hand-insert-v3": "Insert the gripper into a hole",
    "drawer-close-v3": "Push and close a drawer",
    "drawer-open-v3": "Open a drawer",
    "faucet-open-v3": "Rotate the faucet counter-clockwise",
    "faucet-close-v3": "Rotate the faucet clockwise",
    "hammer-v3": "Hammer a screw on the wall",
    "handle-press-side-v3": "Press a handle down sideways",
    "handle-press-v3": "Press a handle down",
    "handle-pull-side-v3": "Pull a handle up sideways",
    "handle-pull-v3": "Pull a handle up",
    "lever-pull-v3": "Pull a lever down 90 degrees",
    "peg-insert-side-v3": "Insert a peg sideways",
    "pick-place-wall-v3": "Pick a puck, bypass a wall and place the puck",
    "pick-out-of-hole-v3": "Pick up a puck from a hole",
    "reach-v3": "Reach a goal position",
    "push-back-v3": "Push the puck to a goal",
    "push-v3": "Push the puck to a goal",
    "pick-place-v3": "Pick and place a puck to a goal",
    "plate-slide-v3": "Slide a plate into a cabinet",
    "plate-slide-side-v3": "Slide a plate into a cabinet sideways",
    "plate-slide-back-v3": "Get a plate from the cabinet",
    "plate-slide-back-side-v3": "Get a plate from the cabinet sideways",
    "peg-unplug-side-v3": "Unplug a peg sideways",
    "soccer-v3": "Kick a soccer into the goal",
    "stick-push-v3": "Grasp a stick and push a box using the stick",
    "stick-pull-v3": "Grasp a stick and pull a box with the stick",
    "push-wall-v3": "Bypass a wall and push a puck to a goal",
    "reach-wall-v3": "Bypass a wall and reach a goal",
    "shelf-place-v3": "Pick and place a puck onto a shelf",
    "sweep-into-v3": "Sweep a puck into a hole",
    "sweep-v3": "Sweep a puck off the table",
    "window-open-v3": "Push and open a window",
    "window-close-v3": "Push and close a window",
}


@dataclass(frozen=True)
class EnvSpec:
    """`metaworld:push-v3` parsed: the family and its task (None where the family has one)."""

    family: str
    task: str | None
    state: str = "hand"  # MetaWorld: "hand" (LeRobot's 4 dims) or "full" (the 39-d observation)

    @property
    def scene(self) -> str:
        """The simulator and task, whatever the observation convention: what a recorded action replays in."""
        return f"{self.family}:{self.task}" if self.task else self.family

    @property
    def name(self) -> str:
        return self.scene + (f"?state={self.state}" if self.state != "hand" else "")


def split_options(text: str) -> tuple[str, str]:
    """`metaworld:reach-v3?state=full` -> ("metaworld:reach-v3", "full"); no option: "hand"."""
    base, sep, option = text.strip().partition("?")
    key, _, value = option.partition("=")
    if sep and (key.strip() != "state" or value.strip() not in STATE_CHOICES):
        raise UserError(f"--env {text}: the one option is ?state=hand (hand xyz and gripper, LeRobot's convention) or "
                        "?state=full (MetaWorld's 39-d observation).")
    return base, value.strip() if sep else "hand"


def parse_env(text: str) -> EnvSpec:
    """`metaworld:push-v3` -> EnvSpec; an unknown family or task is one sentence naming the known ones."""
    base, state = split_options(text)
    family, _, task = base.partition(":")
    family, task = family.lower(), task.strip() or None
    if family != "metaworld" and state != "hand":
        raise UserError(f"--env {text}: ?state= is an option of metaworld:TASK only.")
    if family == "metaworld":
        if task not in METAWORLD_TEXT:
            near = ", ".join(sorted(t for t in METAWORLD_TEXT if task and task.split("-")[0] in t)[:5]) or "reach-v3, push-v3, pick-place-v3"
            raise UserError(f"--env {text}: MetaWorld has no task '{task}' (for example {near}).")
        return EnvSpec("metaworld", task, state)
    if family == "pusht":
        if task not in (None, "pusht"):
            raise UserError(f"--env {text}: PushT has one task; pass --env pusht.")
        return EnvSpec("pusht", None)
    if family == "aloha":
        if task not in ALOHA_TASKS:
            raise UserError(f"--env {text}: ALOHA's tasks are {', '.join('aloha:' + t for t in ALOHA_TASKS)}.")
        return EnvSpec("aloha", task)
    if family == "libero":
        raise UserError(f"--env {text}: LIBERO needs its assets, which are not present on this machine (hf-libero "
                        "downloads them from the Hub on first use); evaluate in metaworld, pusht or aloha instead.")
    raise UserError(f"--env {text}: unknown simulator; the known ones are {', '.join(ENV_FAMILIES)}.")


# ------------------------------------------------------------------------------------------- rendering on a CPU
GL_FIX = ("install the GL libraries MuJoCo renders with on a CPU (scripts/setup_sim.sh, or `apt-get install libegl1 "
          "libegl-mesa0 libgbm1 libgl1-mesa-dri`)")
GL_BACKENDS = ("egl", "osmesa", "glfw", "glx")
_rendering_checked: set[str] = set()


def prepare_rendering(spec: EnvSpec) -> None:
    """MuJoCo renders offscreen through EGL (Mesa's llvmpipe on a CPU) unless the user chose MUJOCO_GL. Whether the
    backend can render is checked here, once per process, before any simulator starts: a missing GL library (or EGL
    without Mesa's driver) would otherwise be a traceback at the first frame, after the policy was loaded."""
    if spec.family not in ("metaworld", "aloha"):
        return
    backend = os.environ.setdefault("MUJOCO_GL", "egl").strip().lower()
    if backend in _rendering_checked:
        return
    if backend not in GL_BACKENDS:
        raise UserError(f"MUJOCO_GL={backend} is not a MuJoCo rendering backend on Linux: unset it (EGL renders "
                        "offscreen) or choose one of egl, osmesa.")
    if backend in ("glfw", "glx") and not os.environ.get("DISPLAY"):
        raise UserError(f"MUJOCO_GL={backend} needs a display and there is none: unset it, and MuJoCo renders "
                        "offscreen with EGL.")
    if backend in ("egl", "osmesa"):  # PyOpenGL must load the same library MuJoCo renders with
        os.environ.setdefault("PYOPENGL_PLATFORM", backend)
    if backend == "osmesa" and ctypes.util.find_library("OSMesa") is None:
        raise UserError("MUJOCO_GL=osmesa but libOSMesa is missing: `apt-get install libosmesa6`, or unset MUJOCO_GL "
                        "to render with EGL.")
    if backend == "egl" and not _egl_display_opens():
        raise UserError(f"MuJoCo renders with EGL here and no EGL display opens (libEGL or Mesa's EGL driver is "
                        f"missing): {GL_FIX}.")
    _rendering_checked.add(backend)


def _egl_display_opens() -> bool:
    """What MuJoCo's EGL context does first: load libEGL and initialize a display on a device."""
    if ctypes.util.find_library("EGL") is None:
        return False
    try:
        from mujoco.egl import EGL, create_initialized_egl_device_display
    except ImportError as exc:
        if (exc.name or "").startswith("mujoco"):
            raise UserError(f"The simulator package 'mujoco' is not installed: {SIM_EXTRA_FIX}.") from None
        return False
    except Exception:  # PyOpenGL's loader raises its own errors where libEGL cannot load
        return False
    try:
        return create_initialized_egl_device_display() != EGL.EGL_NO_DISPLAY
    except Exception:
        return False


def _import(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UserError(f"The simulator package '{module}' is not installed ({exc.name or exc}): {SIM_EXTRA_FIX}.") from None


def fast_render_settings(model) -> None:
    """Shadows, multisampling and reflections off before the first render: a frame ~10x cheaper on a CPU, the image
    ~9/255 from the default on average (docs/ARCHITECTURE.md, "Closed-loop evaluation")."""
    model.vis.quality.offsamples = 0
    model.vis.quality.shadowsize = 0
    model.light_castshadow[:] = 0
    model.mat_reflectance[:] = 0


# ------------------------------------------------------------------------------------------- the adapters
@dataclass
class Step:
    pixels: dict[str, np.ndarray]  # LeRobot camera key -> uint8 (H, W, 3)
    state: np.ndarray  # float32
    reward: float = 0.0
    success: bool = False
    done: bool = False  # terminated by the env (MetaWorld: at success)


class SimEnv:
    """One simulator: `reset(seed)` and `step(action)` return a Step."""

    spec: EnvSpec
    text: str  # the task's instruction in words
    cameras: list[str]  # LeRobot keys, in order
    state_dim: int
    action_dim: int
    action_low: np.ndarray
    action_high: np.ndarray
    max_steps: int
    fps: int
    image_size: tuple[int, int]  # (height, width) rendered

    def reset(self, seed: int) -> Step:
        raise NotImplementedError

    def step(self, action: np.ndarray) -> Step:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MetaWorldEnv(SimEnv):
    fps = 80

    def __init__(self, spec: EnvSpec, image_size: tuple[int, int], fast: bool = True):
        metaworld = _import("metaworld")
        self.spec, self.text, self.image_size = spec, METAWORLD_TEXT[spec.task], tuple(image_size)
        benchmark = metaworld.MT1(spec.task, seed=42)
        height, width = self.image_size
        self.env = benchmark.train_classes[spec.task](render_mode="rgb_array", camera_name=METAWORLD_CAMERA,
                                                      width=width, height=height)
        self.env.set_task(benchmark.train_tasks[0])
        # Seeded object and goal positions: reset(seed=...) is ignored; env.seed(s) with a fresh random vector per reset.
        self.env._freeze_rand_vec = False
        self.env.seeded_rand_vec = True
        model = self.env.model
        model.cam_pos[model.camera(METAWORLD_CAMERA).id] = METAWORLD_CAMERA_POSITION
        if fast:
            fast_render_settings(model)
        self.state_dim = METAWORLD_FULL_STATE_DIMS if spec.state == "full" else METAWORLD_STATE_DIMS
        self.cameras, self.action_dim = [IMAGE_KEY], 4
        self.action_low = self.env.action_space.low.astype(np.float32)
        self.action_high = self.env.action_space.high.astype(np.float32)
        self.max_steps = int(self.env.max_path_length)
        self.raw = None  # the full 39-d observation (what MetaWorld's scripted experts read)

    def _observe(self, raw, reward=0.0, success=False) -> Step:
        self.raw = raw
        image = np.ascontiguousarray(np.flip(self.env.render(), (0, 1)))
        return Step({IMAGE_KEY: image}, np.asarray(raw[: self.state_dim], np.float32), reward, success, success)

    def reset(self, seed: int) -> Step:
        self.env.seed(int(seed))
        raw, _ = self.env.reset()
        for site in self.env._target_site_config:  # the goal marker of the previous episode would show in frame 0
            self.env._set_pos_site(*site)
        return self._observe(raw)

    def step(self, action: np.ndarray) -> Step:
        raw, reward, _, _, info = self.env.step(np.asarray(action, np.float32))
        return self._observe(raw, float(reward), bool(info.get("success", 0)))

    def close(self) -> None:
        self.env.close()


class GymEnv(SimEnv):
    """gym-pusht and gym-aloha: `pixels` (or `pixels.<cam>`) and `agent_pos`, success in info['is_success']."""

    def __init__(self, spec: EnvSpec, image_size: tuple[int, int] | None):
        gym = _import("gymnasium")
        if spec.family == "pusht":
            _import("gym_pusht")
            kwargs = {"obs_type": "pixels_agent_pos"}
            if image_size is not None:
                kwargs.update(observation_height=image_size[0], observation_width=image_size[1])
            self.env = gym.make("gym_pusht/PushT-v0", disable_env_checker=True, **kwargs)
            self.text, self.fps, self.cameras = PUSHT_TEXT, 10, [IMAGE_KEY]
        else:
            _import("gym_aloha")
            # gym-aloha 0.1.5 renders its top camera at 480x640 whatever size it is asked for: the policy resizes.
            self.env = gym.make(ALOHA_TASKS[spec.task], disable_env_checker=True, obs_type="pixels_agent_pos")
            self.text, self.fps, self.cameras = ALOHA_TEXT[spec.task], 50, ["observation.images.top"]
        self.spec = spec
        self.max_steps = int(self.env.spec.max_episode_steps or 300)
        self.state_dim = int(self.env.observation_space["agent_pos"].shape[0])
        self.action_dim = int(self.env.action_space.shape[0])
        self.action_low = self.env.action_space.low.astype(np.float32)
        self.action_high = self.env.action_space.high.astype(np.float32)
        pixels = self.env.observation_space["pixels"]
        self.image_size = tuple((pixels if spec.family == "pusht" else pixels["top"]).shape[:2])

    def _observe(self, obs, reward=0.0, info=None, terminated=False) -> Step:
        pixels = obs["pixels"]
        images = {IMAGE_KEY: pixels} if self.spec.family == "pusht" else {"observation.images.top": pixels["top"]}
        images = {k: np.ascontiguousarray(v) for k, v in images.items()}
        success = bool((info or {}).get("is_success", False))
        return Step(images, np.asarray(obs["agent_pos"], np.float32), reward, success, bool(terminated))

    def reset(self, seed: int) -> Step:
        obs, info = self.env.reset(seed=int(seed))
        return self._observe(obs)

    def step(self, action: np.ndarray) -> Step:
        obs, reward, terminated, _, info = self.env.step(np.asarray(action, np.float32))
        return self._observe(obs, float(reward), info, terminated)

    def close(self) -> None:
        self.env.close()


def make_env(spec: EnvSpec, image_size: tuple[int, int] | None = None, fast_render: bool = True) -> SimEnv:
    """The adapter of `spec`, rendering at `image_size` (height, width; None: the env's own size, MetaWorld 480)."""
    prepare_rendering(spec)
    if spec.family == "metaworld":
        return MetaWorldEnv(spec, image_size or (480, 480), fast_render)
    env = GymEnv(spec, image_size)
    if spec.family == "aloha" and fast_render:
        fast_render_settings(env.env.unwrapped._env.physics.model.ptr)  # dm_control's physics over MuJoCo's model
    return env


def policy_inputs(step: Step) -> dict[str, np.ndarray]:
    """The observation as LeRobot's preprocessing is handed it: each camera float32 (3, H, W) in [0, 1], the state
    float32."""
    out = {key: pixels.transpose(2, 0, 1).astype(np.float32) / np.float32(255) for key, pixels in step.pixels.items()}
    out[STATE_KEY] = step.state.astype(np.float32)
    return out
