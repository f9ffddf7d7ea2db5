"""configs/examples/k8s_job_remote.yaml against the Kubernetes API's own schema: the official client's models
(`kubernetes`, generated from the API's OpenAPI specification) read it as a batch/v1 Job, with the types and
required fields they check, and write back every key it holds (a misspelled or misplaced key is one they drop)."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import yaml

from conftest import EXAMPLES

pytestmark = pytest.mark.full

MANIFEST = EXAMPLES / "k8s_job_remote.yaml"


@pytest.fixture(scope="module")
def client():
    try:
        import kubernetes.client as client
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("the `kubernetes` package is not installed; run `pip install -e .[dev]`")
        pytest.skip("the `kubernetes` package is not installed")
    return client


def test_the_kubernetes_job_is_a_valid_batch_v1_job_every_key_of_which_the_api_knows(client):
    written = yaml.safe_load(MANIFEST.read_text())
    api = client.ApiClient()
    job = api.deserialize(json.dumps(written), "V1Job", "application/json")  # types and required fields checked as it is read
    assert isinstance(job, client.V1Job)
    assert api.sanitize_for_serialization(job) == written


def test_the_kubernetes_job_relies_on_what_the_readme_says(client):
    spec = yaml.safe_load(MANIFEST.read_text())["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] >= 1  # a new pod, on any node, per failure
    command = " ".join(pod["containers"][0]["args"])
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "exec" and argv[1:3] == ["opentau", "train"]  # SIGTERM reaches opentau itself
    assert "--resume=auto" in argv
    drain = next(float(a.split("=", 1)[1]) for a in argv if a.startswith("--checkpoint.remote_drain_seconds="))
    assert pod["terminationGracePeriodSeconds"] > drain  # the save and its upload before the kubelet's SIGKILL
