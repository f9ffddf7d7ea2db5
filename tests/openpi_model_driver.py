"""Run with openpi's source (OPENPI_SRC) in the lerobot-openpi venv of scripts/peer_envs.sh (transformers 4.53.2 with
openpi's transformers_replace files): builds openpi's PyTorch pi05 (`PI0Pytorch`), loads an openpi export's
model.safetensors as openpi's serving code does (strict `safetensors.torch.load_model`), and acts on one observation
through openpi's own transforms: `Normalize` (quantiles) with the export's assets/<asset_id>/norm_stats.json,
`TokenizePrompt` (the binned state in the prompt), `PadStatesAndActions`, the model's `sample_actions`, `Unnormalize`.
Usage: python openpi_model_driver.py OPENPI_SRC EXPORTS TOKENIZER_DIR SIZES.json IN.npz OUT.json

EXPORTS: comma-separated export directories or Hub repo ids `USER/REPO@REVISION`; a repo id is downloaded first with
this venv's huggingface_hub (`snapshot_download`, what `hf download` runs; HF_ENDPOINT names the Hub), as an openpi user
fetches a checkpoint folder by repo id. One model is built, and each export's weights are loaded into it strictly.
OUT.json: {export: its result} in the order given.

Replaced, and only these: the JAX-side modules openpi's PyTorch path imports but never calls here (jax, flax's dict
flattening, orbax, sentencepiece, openpi-client's image tools, openpi's array typing), `openpi.models.gemma.get_config`
(it answers with the exported model's sizes), the sizes openpi fixes in its class to PaliGemma-3B's (vision tower,
projector width, 257152-token vocabulary), and PaliGemma's SentencePiece model (a download), whose place a local
Hugging Face tokenizer takes."""

import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
# transformers first: it probes for jax / flax / sentencepiece when imported, before the stand-ins below exist.
from safetensors.torch import load_model
from transformers import AutoTokenizer, GemmaForCausalLM, PaliGemmaForConditionalGeneration  # noqa: F401

openpi_src, exports, tokenizer_dir, sizes_path, in_path, out_path = sys.argv[1:7]
sys.path.insert(0, str(Path(openpi_src) / "src"))
with open(sizes_path) as f:
    sizes = json.load(f)


class Inert:
    """Any name of a stand-in module: usable in annotations (also subscripted) and never called here."""

    def __class_getitem__(cls, item):
        return cls


def stand_in(name: str, **names) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(names)
    module.__getattr__ = lambda attr: Inert
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:  # `import a.b.c as x` reads it as an attribute of its parent
        setattr(sys.modules[parent], child, module)
    return module


def flatten_dict(tree, sep="/", prefix=""):  # flax.traverse_util's, for nested dicts of leaves
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{sep}{key}" if prefix else key
        out.update(flatten_dict(value, sep, name) if isinstance(value, dict) and value else {name: value})
    return out


def unflatten_dict(flat, sep="/"):
    tree = {}
    for name, value in flat.items():
        *parents, last = name.split(sep)
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    return tree


import openpi.models  # noqa: E402  openpi's own (empty) packages, for the stand-ins of some of their modules
import openpi.shared  # noqa: E402

for name in ("jax", "jax.numpy", "orbax", "orbax.checkpoint", "sentencepiece", "openpi_client", "openpi_client.image_tools",
             "openpi.shared.array_typing", "openpi.shared.download", "openpi.shared.image_tools",
             "openpi.models.utils", "openpi.models.utils.fsq_tokenizer"):
    stand_in(name)
stand_in("flax")
sys.modules["flax"].traverse_util = stand_in("flax.traverse_util", flatten_dict=flatten_dict, unflatten_dict=unflatten_dict)


def get_config(variant: str):
    return types.SimpleNamespace(**sizes["gemma"][variant])


stand_in("openpi.models.gemma", get_config=get_config)

import openpi.models_pytorch.gemma_pytorch as gemma_pytorch  # noqa: E402
import openpi.models_pytorch.pi0_pytorch as pi0_pytorch  # noqa: E402
import openpi.transforms as transforms  # noqa: E402
from openpi.models.tokenizer import PaligemmaTokenizer  # noqa: E402
from openpi.shared import normalize  # noqa: E402
from peer_model_sizes import sized_classes  # noqa: E402

sized_paligemma, sized_expert = sized_classes(gemma_pytorch.PaliGemmaForConditionalGeneration,
                                             gemma_pytorch.GemmaForCausalLM, sizes)
gemma_pytorch.PaliGemmaForConditionalGeneration = sized_paligemma
gemma_pytorch.GemmaForCausalLM = sized_expert


class SentencePieceStandIn:
    """The one call openpi's PaligemmaTokenizer makes of its SentencePiece processor, on a Hugging Face tokenizer."""

    def __init__(self, path):
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text, add_bos=False):
        ids = self.tok.encode(text, add_special_tokens=False)
        return [self.tok.bos_token_id, *ids] if add_bos else ids


def local(export: str) -> Path:
    """An export directory, or a repo id's files downloaded at that revision."""
    if Path(export).exists():
        return Path(export)
    from huggingface_hub import snapshot_download

    repo_id, _, revision = export.partition("@")
    return Path(snapshot_download(repo_id, revision=revision or None))


with np.load(in_path) as data:
    given = {k: data[k] for k in data.files}
model, results = None, {}
for export in exports.split(","):
    folder = local(export)
    exported = json.loads((folder / "config.json").read_text())
    model_config = types.SimpleNamespace(pi05=exported["pi05"], paligemma_variant="gemma_2b", action_expert_variant="gemma_300m",
                                         dtype=exported["precision"], action_dim=exported["action_dim"],
                                         action_horizon=exported["action_horizon"], pytorch_compile_mode=None)
    if model is None:
        model = pi0_pytorch.PI0Pytorch(config=model_config)
    load_model(model, str(folder / "model.safetensors"))  # strict, as openpi's load_pytorch
    model.eval()

    (assets,) = [p for p in (folder / "assets").iterdir() if p.is_dir()]
    norm_stats = normalize.load(assets)
    tokenizer = PaligemmaTokenizer.__new__(PaligemmaTokenizer)  # its __init__ downloads PaliGemma's SentencePiece model
    tokenizer._max_len, tokenizer._tokenizer = exported["max_token_len"], SentencePieceStandIn(tokenizer_dir)  # noqa: SLF001

    inputs = transforms.compose([
        transforms.Normalize(norm_stats, use_quantiles=True),
        transforms.TokenizePrompt(tokenizer, discrete_state_input=True),
        transforms.PadStatesAndActions(model_config.action_dim),
    ])({"state": given["state"].astype(np.float32), "prompt": str(given["task"])})

    cameras = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    images, masks = {}, {}
    for i, camera in enumerate(cameras):  # openpi's images are in [-1, 1]; a robot's missing cameras come masked
        images[camera] = torch.from_numpy(given["images"][i][None]) * 2 - 1
        masks[camera] = torch.tensor([bool(given["image_masks"][i])])
    observation = types.SimpleNamespace(
        images=images, image_masks=masks, state=torch.from_numpy(inputs["state"][None]).float(),
        tokenized_prompt=torch.from_numpy(inputs["tokenized_prompt"][None]).long(),
        tokenized_prompt_mask=torch.from_numpy(inputs["tokenized_prompt_mask"][None]).bool(),
        token_ar_mask=None, token_loss_mask=None)
    with torch.no_grad():
        chunk = model.sample_actions("cpu", observation, noise=torch.from_numpy(given["noise"]), num_steps=int(given["num_steps"]))
    # openpi's Policy.infer hands its output transforms the model's state with the actions
    outputs = transforms.Unnormalize(norm_stats, use_quantiles=True)({"state": inputs["state"], "actions": chunk[0].numpy()})
    width = len(norm_stats["actions"].q01)  # a robot's output transform keeps its own action dims
    results[export] = {"actions": outputs["actions"][:, :width].tolist(), "input_ids": inputs["tokenized_prompt"].tolist(),
                       "files": sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())}
with open(out_path, "w") as f:
    json.dump(results, f)
