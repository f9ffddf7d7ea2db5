"""Run with LeRobot 0.4.4's own package plus openpi's transformers_replace files (the lerobot-openpi venv of
scripts/peer_envs.sh): loads an export with `PI05Policy.from_pretrained` and its own pre/post-processor files, and
writes the action chunk it returns for one observation and one noise draw.
Usage: python lerobot_policy_driver.py EXPORTS TOKENIZER_DIR SIZES.json IN.npz OUT.json

EXPORTS: comma-separated export directories or Hub repo ids `USER/REPO@REVISION`, each given as it is to LeRobot's
`from_pretrained` (a repo id with its `revision`: LeRobot downloads the files through the Hub cache; HF_ENDPOINT names
the Hub). OUT.json: {export: its result} in the order given.

SIZES.json: the model's sizes. LeRobot's pi05 knows only PaliGemma-3B's (`get_gemma_config` has its two Gemma
variants; the vision tower, projector width and 257152-token vocabulary are set in the class), so those are set to
the exported model's before its transformers classes are built; nothing else of LeRobot is replaced.
TOKENIZER_DIR: a local Hugging Face tokenizer, given to LeRobot's tokenizer step in place of PaliGemma's (a download)."""

import contextlib
import io
import json
import os
import re
import sys

import numpy as np
import torch
from transformers import AutoModel  # noqa: F401  transformers' lazy modules first: LeRobot's import chain otherwise
                                    # hits a circular import inside transformers 4.53
from transformers import AutoTokenizer

import lerobot.policies.pi05.modeling_pi05 as modeling_pi05
from lerobot.policies.pi05.modeling_pi05 import PI05Policy
from lerobot.processor import PolicyProcessorPipeline
from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action
from peer_model_sizes import size_lerobot_pi05

exports, tokenizer_dir, sizes_path, in_path, out_path = sys.argv[1:6]
with open(sizes_path) as f:
    sizes = json.load(f)


size_lerobot_pi05(modeling_pi05, sizes)

tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
with np.load(in_path) as data:
    given = {k: data[k] for k in data.files}
results = {}
for export in exports.split(","):
    # A directory as it is; a repo id with its revision, as a robot computer pulls a policy.
    source, revision = (export, None) if os.path.exists(export) else export.split("@")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        policy = PI05Policy.from_pretrained(source, revision=revision)
    # LeRobot's loader prints what it did and keeps the initial values of what it could not load. Its strict load
    # misses the token embedding in every file LeRobot's own save_pretrained writes (tied to lm_head, which safetensors
    # keeps and torch loads into the shared tensor): that key, and only that one, may be reported.
    report = printed.getvalue()
    tied = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    paligemma = policy.model.paligemma_with_expert.paligemma
    loaded = "All keys loaded successfully!" in report or (
        re.findall(r'"([^"]+)"', report.partition("Missing key(s) in state_dict:")[2]) == [tied]
        and "Unexpected key(s)" not in report and "Missing key(s)" in report
        and paligemma.model.language_model.embed_tokens.weight.data_ptr() == paligemma.lm_head.weight.data_ptr())
    if not loaded:
        sys.exit(f"LeRobot did not load every key of {export}:\n{report}")
    policy.eval()

    pre = PolicyProcessorPipeline.from_pretrained(source, config_filename="policy_preprocessor.json", revision=revision,
                                                  overrides={"tokenizer_processor": {"tokenizer": tokenizer}})
    post = PolicyProcessorPipeline.from_pretrained(source, config_filename="policy_postprocessor.json", revision=revision,
                                                   to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
    observation = {"observation.state": torch.from_numpy(given["state"]), "task": str(given["task"])}
    for i, camera in enumerate(policy.config.image_features):
        observation[camera] = torch.from_numpy(given["images"][i])
    batch = pre(observation)
    with torch.no_grad():
        chunk = policy.predict_action_chunk(batch, noise=torch.from_numpy(given["noise"]))
    actions = post(chunk)
    results[export] = {"cameras": list(policy.config.image_features), "actions": actions.tolist(),
                       "input_ids": batch["observation.language.tokens"].tolist()}
with open(out_path, "w") as f:
    json.dump(results, f)
