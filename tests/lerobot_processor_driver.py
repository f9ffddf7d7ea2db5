"""Run with LeRobot 0.4.4's own package (its venv from scripts/peer_envs.sh): loads an export's config.json and
processor files with LeRobot's loaders and writes what they make of one observation and one normalized action chunk.
Usage: python lerobot_processor_driver.py EXPORT_DIR IN.npz OUT.json"""

import json
import sys

import numpy as np
import torch
from transformers import AutoModel  # noqa: F401  transformers' lazy modules first: LeRobot's import chain otherwise
                                    # hits a circular import inside transformers 4.53
from lerobot.configs.policies import PreTrainedConfig
from lerobot.policies.pi05.configuration_pi05 import PI05Config  # noqa: F401  registers the "pi05" config type
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
from lerobot.processor.core import TransitionKey


class WordCount:
    """Stands in for PaliGemma's tokenizer (a download): LeRobot's step only needs it callable; the prompt text it
    is given is what is compared."""

    def __call__(self, texts, max_length, **kwargs):
        ids = torch.zeros(len(texts), max_length, dtype=torch.long)
        mask = torch.zeros(len(texts), max_length, dtype=torch.long)
        for i, text in enumerate(texts):
            mask[i, : min(max_length, len(text.split()))] = 1
        return {"input_ids": ids, "attention_mask": mask}


export, in_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
with np.load(in_path) as data:
    given = {k: data[k] for k in data.files}
config = PreTrainedConfig.from_pretrained(export)  # as PI05Policy.from_pretrained reads it
pre = PolicyProcessorPipeline.from_pretrained(export, config_filename="policy_preprocessor.json",
                                              overrides={"tokenizer_processor": {"tokenizer": WordCount()}})
post = PolicyProcessorPipeline.from_pretrained(export, config_filename="policy_postprocessor.json",
                                               to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
camera = list(config.image_features)[0]
observation = {camera: torch.from_numpy(given["image"]), "observation.state": torch.from_numpy(given["state"]),
               "task": str(given["task"])}
transition = pre.to_transition(observation)
for step in pre.steps[:4]:  # up to and including the state-binning step: the prompt before tokenization
    transition = step(transition)
processed = pre(observation)  # every step, as LeRobot's policy receives the batch
actions = post(torch.from_numpy(given["normalized_actions"]))
out = {
    "image_features": list(config.image_features),
    "input_features": {k: [v.type.name, list(v.shape)] for k, v in config.input_features.items()},
    "output_features": {k: [v.type.name, list(v.shape)] for k, v in config.output_features.items()},
    "max_state_dim": config.max_state_dim,
    "steps": [type(s).__name__ for s in pre.steps],
    "normalized_state": transition[TransitionKey.OBSERVATION]["observation.state"].tolist(),
    "prompt": transition[TransitionKey.COMPLEMENTARY_DATA]["task"],
    "processed_keys": sorted(processed),
    "actions": actions.tolist(),
}
with open(out_path, "w") as f:
    json.dump(out, f)
