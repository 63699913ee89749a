"""deploy/: the KubeRay manifest, checked against KubeRay's RayCluster schema (v1, as its
CRD declares it; tests/data/kuberay-raycluster-v1.schema.json, descriptions dropped) and
each pod template against Kubernetes' own schema, strictly (no unknown field); and the
command it runs against pdserve's own flags."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from launch.cluster import plan as cluster_plan
from launch.ray import cluster as ray_cluster

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kuberay-raycluster.yaml"
KUBERNETES_VERSION = "1.30"


def _cluster() -> dict:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert [d["kind"] for d in docs] == ["RayCluster"]
    return docs[0]


def _templates(cluster: dict) -> list[dict]:
    return [cluster["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["spec"]["workerGroupSpecs"]
    ]


def test_the_manifest_is_a_valid_raycluster():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "tests/data/kuberay-raycluster-v1.schema.json").read_text())
    cluster = _cluster()
    assert cluster["apiVersion"] == "ray.io/v1"
    jsonschema.validate(cluster, schema)
    broken = json.loads(json.dumps(cluster))
    broken["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):  # the schema does reject what KubeRay would
        jsonschema.validate(broken, schema)


def test_each_pod_template_is_valid_kubernetes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for template in _templates(_cluster()):
        obj = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "pdserve"},
            "template": template,
        }
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    bad = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "x"},
        "template": {"spec": {"containers": [{"name": "c", "image": "i", "portz": []}]}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_head_runs_pdserve_on_ray_and_exposes_its_ports():
    head = _cluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    args = shlex.split(next(e["value"] for e in head["env"] if e["name"] == "PDSERVE_SERVE_ARGS"))
    ours, rest = ray_cluster.split_args(args)
    assert ours["address"] == "auto"
    opts = cluster_plan.parse(rest)  # pdserve's own parser: a flag it does not know fails here
    assert not any(getattr(opts, d) for d in ray_cluster.NOT_WITH_RAY)
    ports = {p["containerPort"] for p in head["ports"]}
    assert {int(opts.base_port), int(opts.http_port), 6379} <= ports
    assert (
        "pdserve serve $PDSERVE_SERVE_ARGS" in head["lifecycle"]["postStart"]["exec"]["command"][-1]
    )
