"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (bundled with
kubernetes-validate: offline), and agree with the code: every container's args parse with the
real `mili` CLI, its ports, probes and annotations are the ports those args open, Services
point at ports that exist, the frontend's DNS targets name the headless Services, the grace
period covers preStop + drain. The Dockerfiles install what `make setup` (the README's set-up)
installs."""

from __future__ import annotations

import argparse
import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from mili.cli import build_parser
from mili.discovery import parse_target, parse_targets
from mili.rpc.server import LIVENESS
from mili.rpc.server_config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"
GPU = ROOT / "deploy" / "kubernetes" / "overlays" / "gpu"
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile*"))
K8S_VERSION = "1.33.0"  # the oldest release we promise: native grpc probes and preStop sleep


def _kustomization(directory: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return data


def _load(directory: Path) -> list[dict[str, Any]]:
    """The objects a kustomization renders: resources (recursively), its namespace, and its
    JSON 6902 patches (the only kind these manifests use)."""
    kust = _kustomization(directory)
    docs: list[dict[str, Any]] = []
    for resource in kust.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs += _load(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if "namespace" in kust:
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = kust["namespace"]
    for patch in kust.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        target = patch["target"]
        matched = [
            d
            for d in docs
            if d["kind"] == target["kind"] and re.fullmatch(target["name"], d["metadata"]["name"])
        ]
        assert matched, f"patch {patch['path']} matches nothing"
        for doc in matched:
            for op in ops:
                _apply(doc, op)
    return docs


def _apply(doc: dict[str, Any], op: dict[str, Any]) -> None:
    *parents, last = op["path"].strip("/").split("/")
    node: Any = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    value = copy.deepcopy(op["value"])
    if op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), value)
    elif op["op"] in ("add", "replace"):
        if op["op"] == "replace":
            assert last in node, f"replace {op['path']}: nothing there"
        node[last] = value
    else:
        raise AssertionError(f"unsupported patch op {op['op']}")


RENDERED = {"base": _load(BASE), "gpu": _load(GPU)}


def _validator() -> Any:
    """kubernetes_validate, or a skip: it is a dev dependency the GPU host does not install, and
    only the schema tests need it (the rest of this file still runs there)."""
    return pytest.importorskip("kubernetes_validate")


@pytest.mark.parametrize("variant", RENDERED)
def test_every_object_validates_against_the_kubernetes_schema(variant: str) -> None:
    docs = RENDERED[variant]
    kubernetes_validate = _validator()
    kinds = {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    assert {d["kind"] for d in docs} == kinds
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_catches_a_misspelled_field() -> None:
    """The check above can fail (an unknown field, as a typo makes)."""
    kubernetes_validate = _validator()
    doc = copy.deepcopy(_deployments("base")["decode"])
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grcp"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _deployments(variant: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in RENDERED[variant]
        if d["kind"] == "Deployment"
    }


def _parse(container: dict[str, Any]) -> argparse.Namespace:
    """The container's command line, parsed by the real CLI (SystemExit = a bad flag)."""
    assert container["command"] == ["mili"]
    argv = [a for a in container["args"]]
    try:
        return build_parser(argv).parse_args(argv)
    except SystemExit as e:  # argparse printed why
        raise AssertionError(f"mili {shlex.join(argv)} does not parse") from e


@pytest.mark.parametrize("variant", RENDERED)
@pytest.mark.parametrize("component", ["tokenizer", "prefill", "decode", "frontend"])
def test_args_ports_probes_and_grace_agree_with_the_cli(variant: str, component: str) -> None:
    deployment = _deployments(variant)[component]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = _parse(container)
    assert args.command == f"serve-{component}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"grpc": args.port, "metrics": args.metrics_port, "health": args.health_port}
    if component == "frontend":
        expected["http"] = args.http_port
    assert ports == expected
    assert args.host == "0.0.0.0"  # reachable from other pods; the default is loopback
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    # Probes: plaintext grpc.health.v1 on --health-port; readiness the whole server,
    # liveness (and start-up) the entry that stays SERVING through a drain.
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe in probes.values():
        assert probe["grpc"]["port"] == args.health_port
    assert probes["readinessProbe"]["grpc"].get("service", "") == ""
    assert probes["livenessProbe"]["grpc"]["service"] == LIVENESS
    assert probes["startupProbe"]["grpc"]["service"] == LIVENESS
    # mTLS files come from the Secret's mount.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"]}
    assert secrets["tls"] == "mili-tls"
    for path in (args.tls_cert, args.tls_key, args.tls_ca):
        assert path is not None and str(path).startswith(mounts["tls"] + "/")
    # SIGKILL comes after preStop + the drain + grpc's grace, never during them.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace_s = ServerConfig().grace_s
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + args.drain_timeout + grace_s
    # preStop outlasts the frontend's re-resolution, so it stops routing here before we drain.
    frontend = _parse(
        _deployments(variant)["frontend"]["spec"]["template"]["spec"]["containers"][0]
    )
    assert pre_stop > frontend.resolve_interval
    if variant == "gpu" and component in ("prefill", "decode"):
        assert args.device == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"] == "mili:cuda"
    else:
        assert getattr(args, "device", "cpu") == "cpu"
        assert "limits" not in container["resources"]
        assert container["image"] == "mili:cpu"


def _services(variant: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in RENDERED[variant] if d["kind"] == "Service"}


def _service_for(host: str, variant: str) -> dict[str, Any]:
    name, namespace, *rest = host.split(".")
    assert rest == ["svc", "cluster", "local"], host
    service = _services(variant)[name]
    assert service["metadata"]["namespace"] == namespace
    return service


@pytest.mark.parametrize("variant", RENDERED)
def test_services_select_pods_and_ports_that_exist(variant: str) -> None:
    deployments = _deployments(variant)
    for service in _services(variant).values():
        selector = service["spec"]["selector"]
        (match,) = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        (container,) = match["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names
        component = match["metadata"]["labels"]["app.kubernetes.io/component"]
        # Prefill and decode are headless (one A record per pod: discovery sees every
        # instance); the tokenizer and the frontend sit behind one virtual IP.
        is_headless = service["spec"].get("clusterIP") == "None"
        assert is_headless == (component in ("prefill", "decode")), component


@pytest.mark.parametrize("variant", RENDERED)
def test_a_drain_takes_one_pod_of_a_component_at_a_time(variant: str) -> None:
    """Every Deployment has a PodDisruptionBudget over exactly its pods that leaves one
    serving (found by a read-only review: none existed, so a node drain could evict both
    decodes at once and fail every request)."""
    budgets = [d for d in RENDERED[variant] if d["kind"] == "PodDisruptionBudget"]
    for name, deployment in _deployments(variant).items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        (budget,) = [
            b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert budget["spec"]["selector"] == deployment["spec"]["selector"], name
        assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"], name


@pytest.mark.parametrize("variant", RENDERED)
def test_dns_targets_name_the_headless_services_on_their_ports(variant: str) -> None:
    containers = {
        c: d["spec"]["template"]["spec"]["containers"][0] for c, d in _deployments(variant).items()
    }
    frontend = _parse(containers["frontend"])
    prefill = _parse(containers["prefill"])
    uses = [("prefill", t) for t in parse_targets([frontend.prefill])]
    uses += [("decode", t) for t in parse_targets([frontend.decode])]
    uses += [("decode", t) for t in parse_targets(prefill.decode)]
    for component, target in uses:
        assert target.is_dns, target
        service = _service_for(target.host, variant)
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
        assert target.port in {p["port"] for p in service["spec"]["ports"]}
        assert target.port == _parse(containers[component]).port
    tokenizer = parse_target(frontend.tokenizer)
    service = _service_for(tokenizer.host, variant)
    assert tokenizer.port == _parse(containers["tokenizer"]).port
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "tokenizer"


# ---- Dockerfiles ---------------------------------------------------------------------------


def _makefile_installs() -> list[str]:
    """The pip commands of `make setup`, with the Makefile's variables filled in."""
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) [:?]?= (.+)$", text, re.M))
    recipe = text.split("$(VENV)/.installed:", 1)[1].split("\n\n", 1)[0]
    commands = []
    for line in recipe.splitlines()[1:]:
        line = line.strip()
        if " pip install" not in line:
            continue
        while "$(" in line:  # variables name variables: PY := $(VENV)/bin/python
            line = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], line)
        commands.append(line.replace(f"{variables['VENV']}/bin/python", "python"))
    return commands


def _docker_installs(path: Path) -> list[str]:
    """RUN lines of a Dockerfile that pip install, torch's --index-url dropped (the one
    difference allowed: which build of the same torch version)."""
    runs = re.findall(r"^RUN (.+)$", path.read_text(), re.M)
    return [re.sub(r" --index-url \S+", "", r).strip() for r in runs if " pip install" in r]


def test_the_makefile_is_what_the_readme_installs_with() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve   # installs into .venv" in readme
    assert len(_makefile_installs()) == 3


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_install_what_the_readme_installs_and_prebuild_kernels(
    dockerfile: Path,
) -> None:
    assert _docker_installs(dockerfile) == _makefile_installs()
    text = dockerfile.read_text()
    gpu = " --gpu" if dockerfile.name.endswith(".cuda") else ""
    build = text.index(f"RUN mili kernels build{gpu} ")
    # Mojo links with the system's C compiler (found by a read-only review: neither base image
    # has one, so neither image built); the service user owns the kernel cache.
    compiler = re.search(r"^RUN apt-get .*install[^\n]*(\\\n[^\n]*)*\bgcc libc6-dev\b", text, re.M)
    assert compiler is not None and compiler.start() < build
    assert "USER 10001" in text and "chown -R 10001 /var/cache/mili" in text
    assert 'ENTRYPOINT ["mili"]' in text
