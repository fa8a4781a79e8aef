"""deploy/rayservice.yaml is a RayService KubeRay accepts (checked offline against the CRD's OpenAPI schema, vendored
from KubeRay v1.7.0, with unknown fields refused as `kubectl apply`'s strict validation does), and it serves
configs/gpu_aggregated.yaml on GPU workers with a head that has no GPU."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import jsonschema
import pytest
import yaml

from configs.app import AppConfig
from tests.conftest import REPO_ROOT

MANIFEST = REPO_ROOT / "deploy/rayservice.yaml"
CRD = REPO_ROOT / "deploy/crd/kuberay-v1.7.0/ray.io_rayservices.yaml"
CRD_SHA256 = "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab"


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever Kubernetes would prune them (objects that list their
    properties and neither allow extra ones nor preserve unknown fields)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    text = CRD.read_bytes()
    assert hashlib.sha256(text).hexdigest() == CRD_SHA256  # the release's file, unchanged (deploy/crd/.../SOURCE)
    crd = yaml.safe_load(text)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    # Kubernetes' structural schemas are OpenAPI 3.0 schemas: JSON Schema draft 4 with extensions (x-kubernetes-*).
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def errors(validator: jsonschema.Validator, document: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_manifest_is_a_valid_rayservice(validator, manifest):
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert errors(validator, manifest) == []


def test_the_validation_catches_what_kubectl_would_refuse(validator, manifest):
    """The check has teeth: a misspelt field, a wrong type and a missing required field each fail it."""
    misspelt = copy.deepcopy(manifest)
    misspelt["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 2
    wrong_type = copy.deepcopy(manifest)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    missing = copy.deepcopy(manifest)
    del missing["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    for broken in (misspelt, wrong_type, missing):
        assert errors(validator, broken), broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def test_it_serves_the_shipped_gpu_config(manifest):
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    (shipped,) = yaml.safe_load((REPO_ROOT / "configs/gpu_aggregated.yaml").read_text())["applications"]
    assert application == shipped  # one config, not two that drift apart
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000}  # reachable through the pod's port
    AppConfig.model_validate(application["args"])


def test_gpus_are_on_the_workers_and_enough_for_the_pool(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    pool = AppConfig.model_validate(yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]).pool
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    (workers,) = cluster["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    gpus_per_pod = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    # Every replica finds a GPU with the pods that always run, within the per-node cap.
    assert workers["minReplicas"] * min(gpus_per_pod, pool.max_replicas_per_node) >= pool.num_replicas * pool.num_gpus
    assert worker["image"] == head_container["image"]
    assert cluster["rayVersion"] == "2.60.0"
    assert '"ray[serve]==2.60.0"' in (REPO_ROOT / "pyproject.toml").read_text()


def test_the_readmes_ports_are_open(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    (worker,) = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    head_ports = {p["containerPort"] for p in head["ports"]}
    assert {6379, 8265, 8000, 8080} <= head_ports  # GCS, dashboard (serve deploy), Serve's HTTP, metrics
    assert {8000, 8080} <= {p["containerPort"] for p in worker["ports"]}  # Serve's proxy on every node, metrics
