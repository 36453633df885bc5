"""docker/: the Dockerfile and the compose file, checked without a Docker engine.

No Docker engine (and no `docker compose`) runs where these tests run, so they check
what can be checked:

- compose.yaml, interpolated as Compose does (`${VAR:-default}`, `$$`), is valid
  against the Compose Specification's JSON schema (the copy that check-jsonschema
  ships, so no network), and holds together: Redis with AOF and a volume, two brokers
  on it through SKMQ_REDIS_URL, the consumer, the Spark audit; names and flags are
  the ones skmq really takes (its own settings model and argument parsers);
- the Dockerfile's stages, and the broker image's ENTRYPOINT + CMD and HEALTHCHECK,
  run for real: the package is installed, from only the files the Dockerfile copies,
  into a fresh virtualenv (offline: `--no-deps --no-build-isolation`, the dependencies
  coming from this interpreter's site-packages), `skmq serve` is started with the
  image's environment (but on loopback and free ports), and the HEALTHCHECK command
  must pass while the broker is up and fail once its Redis is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skmq.auth import broker_tokens
from skmq.cli import build_parser
from skmq.config import Settings

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
SETTING_NAMES = {f"SKMQ_{name.upper()}" for name in Settings.model_fields}
WAIT = 20.0  # upper bound of every wait on a process in this module


# --- Dockerfile -------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [args for instr, args in self.instructions if instr == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile: continuations joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        lines.append((pending + line).strip())
        pending = ""
    assert not pending, "a continuation line runs off the end of the Dockerfile"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        instr, _, args = line.partition(" ")
        instr, args = instr.upper(), args.strip()
        if instr == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m[1], ""), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, base))
        elif not stages:
            assert instr == "ARG", f"only ARG may come before the first FROM, not {instr}"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((instr, args))
    return global_args, stages


def stage_chain(stages: list[Stage], name: str) -> list[Stage]:
    """The stage called `name` and the stages it is built FROM, base first."""
    by_name = {s.name: s for s in stages}
    chain = [by_name[name]]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


def env_of(chain: list[Stage]) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in chain:
        for args in stage.all("ENV"):
            for word in shlex.split(args):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {args!r}: use the KEY=VALUE form"
                env[key] = value
    return env


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_sources(stage: Stage) -> list[str]:
    """Sources of the stage's COPY instructions from the build context (not --from)."""
    sources: list[str] = []
    for args in stage.all("COPY"):
        words = args.split()
        if any(w.startswith("--from=") for w in words):
            continue
        sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def broker_chain(dockerfile: tuple[dict[str, str], list[Stage]]) -> list[Stage]:
    _, stages = dockerfile
    return stage_chain(stages, stages[-1].name)


def test_dockerfile_stages(dockerfile: tuple[dict[str, str], list[Stage]]) -> None:
    _, stages = dockerfile
    names = [s.name for s in stages]
    assert len(set(names)) == len(names)
    # The broker is the last stage: what a plain `docker build` (no --target) makes.
    assert stages[-1].name == "broker"
    assert stage_chain(stages, "broker")[0].base.startswith("python:3.11-slim")
    audit = stage_chain(stages, "audit")
    assert audit[0].base.startswith("python:3.11-slim")
    assert "openjdk-17-jre-headless" in " ".join(audit[-1].all("RUN"))
    # The audit driver's PySpark is pinned to the build arg SPARK_VERSION.
    assert any(a.startswith("SPARK_VERSION=") for a in audit[-1].all("ARG"))
    assert "pyspark==${SPARK_VERSION}" in " ".join(audit[-1].all("RUN"))
    # Every --from names an earlier stage.
    for i, stage in enumerate(stages):
        for args in stage.all("COPY"):
            for ref in re.findall(r"--from=(\S+)", args):
                assert ref in names[:i], f"stage {stage.name}: COPY --from={ref}"


def test_dockerfile_installs_the_package_from_copied_files(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    _, stages = dockerfile
    builder = next(s for s in stages if s.name == "builder")
    sources = copy_sources(builder)
    for needed in ("pyproject.toml", "skmq", "spark"):
        assert needed in sources
    for source in sources:
        if not any(ch in source for ch in "*?["):
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    assert "pip install --no-cache-dir ." in " ".join(builder.all("RUN"))
    # The build context filter lets every copied file through.
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for source in sources:
        assert f"!{source}" in ignore or f"!{source}/" in ignore, source


def test_broker_image_settings(broker_chain: list[Stage]) -> None:
    broker = broker_chain[-1]
    user = broker.last("USER") or ""
    assert user and user.split(":")[0] not in ("root", "0"), "the broker must not run as root"
    assert exec_form(broker.last("ENTRYPOINT") or "null") == ["skmq"]
    assert exec_form(broker.last("CMD") or "null") == ["serve"]
    env = env_of(broker_chain)
    skmq_env = {k: v for k, v in env.items() if k.startswith("SKMQ_")}
    assert set(skmq_env) <= SETTING_NAMES, set(skmq_env) - SETTING_NAMES
    assert skmq_env["SKMQ_HOST"] == "0.0.0.0"
    exposed = {p.split("/")[0] for args in broker.all("EXPOSE") for p in args.split()}
    assert {skmq_env["SKMQ_PORT"], skmq_env["SKMQ_METRICS_PORT"]} <= exposed
    assert broker.all("VOLUME"), "a volume for the data directory"
    assert skmq_env["SKMQ_DATA_DIR"] in " ".join(broker.all("VOLUME"))
    healthcheck = broker.last("HEALTHCHECK") or ""
    options, _, command = healthcheck.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    assert exec_form(command)[0] == "python"  # slim images have no curl


# --- compose.yaml ------------------------------------------------------------------

VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's interpolation of every string value (not keys): $$, $VAR, ${VAR...}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        if m["named"]:
            return env.get(m["named"], "")
        found = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?+])(.*))?", m["braced"], re.S)
        assert found, f"bad interpolation {m[0]!r}"
        name, colon, op, arg = found.groups()
        set_ = name in env and (not colon or env[name] != "")
        if op is None:
            return env.get(name, "")
        if op == "-":
            return env[name] if set_ else arg
        if op == "+":
            return arg if set_ else ""
        assert set_, f"{name} must be set: {arg}"
        return env[name]

    return VAR.sub(one, value)


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    yaml = pytest.importorskip("ruamel.yaml", reason="needs ruamel.yaml (check-jsonschema)")
    raw = yaml.YAML(typ="safe", pure=True).load(COMPOSE.read_text())
    assert isinstance(raw, dict)
    project: dict[str, Any] = interpolate(raw, env or {})
    return project


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """target path -> source (named volume or host path) of the short syntax."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        mounts[target] = source
    return mounts


def parse_command(argv: list[str]) -> argparse.Namespace:
    """`skmq`'s own argument parser, to check the commands the compose file runs."""
    return build_parser(argv).parse_args(argv)


def brokers(project: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in project["services"].items()
        if "SKMQ_REDIS_URL" in environment(svc)
    }


def test_compose_matches_the_compose_spec_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="the compose-spec schema ships with it")
    from importlib.resources import files

    schema_file = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    assert "Compose" in schema.get("title", "")
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    for env in ({}, {"SKMQ_SUBNET": "192.0.2.0/24", "SPARK_VERSION": "4.0.2"}):
        project = load_compose(env)
        errors = sorted(validator_class(schema).iter_errors(project), key=str)
        assert not errors, "\n".join(
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors
        )


def test_compose_references_resolve() -> None:
    project = load_compose()
    services = project["services"]
    _, stages = parse_dockerfile(DOCKERFILE.read_text())
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
        for source in volume_mounts(svc).values():
            if not source.startswith((".", "/")):
                assert source in project.get("volumes", {}), f"{name}: volume {source}"
        for net in svc.get("networks", []):
            assert net in project.get("networks", {}), f"{name}: network {net}"
        build = svc.get("build")
        if build:
            context = (COMPOSE.parent / build["context"]).resolve()
            assert context == ROOT, f"{name}: build context {context}"
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE
            target = next(s for s in stages if s.name == build["target"])
            declared = {a.partition("=")[0] for a in target.all("ARG")}
            assert set(build.get("args", {})) <= declared, f"{name}: build args"
    # Published host ports are all different.
    published = [p.rsplit(":", 1)[0] for svc in services.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published)), published


DURATION = re.compile(r"(\d+(\.\d+)?(ns|us|ms|s|m|h))+")
PORT = re.compile(r"((\d{1,3}\.){3}\d{1,3}:)?(\d+(-\d+)?:)?\d+(-\d+)?(/(tcp|udp))?")
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def test_compose_values_have_compose_types() -> None:
    """What the schema leaves to Compose's loader (it accepts strings everywhere, for
    interpolation) and `docker compose config` would reject."""
    project = load_compose()
    for name, svc in project["services"].items():
        restart = svc.get("restart", "no")
        assert restart in ("no", "always", "unless-stopped") or re.fullmatch(
            r"on-failure(:\d+)?", restart
        ), f"{name}: restart {restart!r}"
        check = svc.get("healthcheck", {})
        for key in ("interval", "timeout", "start_period", "start_interval"):
            if key in check:
                assert DURATION.fullmatch(check[key]), f"{name}: healthcheck {key}"
        assert isinstance(check.get("retries", 0), int), f"{name}: healthcheck retries"
        assert isinstance(check.get("disable", False), bool), f"{name}: healthcheck disable"
        for port in svc.get("ports", []):
            assert PORT.fullmatch(str(port)), f"{name}: port {port!r}"
        raw_env = svc.get("environment", {})
        for value in raw_env.values() if isinstance(raw_env, dict) else raw_env:
            assert isinstance(value, str), f"{name}: quote environment values ({value!r})"
        depends_on = svc.get("depends_on", [])
        for dep in depends_on.values() if isinstance(depends_on, dict) else ():
            assert dep["condition"] in CONDITIONS, f"{name}: depends_on {dep}"
        for entry in svc.get("volumes", []):
            assert len(entry.split(":")) in (2, 3) and entry.split(":")[2:] in ([], ["ro"], ["rw"])


def test_compose_redis_persists() -> None:
    project = load_compose()
    redis = project["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    command = shlex.split(command) if isinstance(command, str) else command
    assert command[0] == "redis-server"
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] == "everysec"
    data = volume_mounts(redis)["/data"]
    assert data in project["volumes"], "Redis keeps /data on a named volume"
    assert redis["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]


@pytest.mark.parametrize("subnet", [None, "192.0.2.0/24"])
def test_compose_brokers_share_one_redis(subnet: str | None, monkeypatch: Any) -> None:
    project = load_compose({"SKMQ_SUBNET": subnet} if subnet else {})
    services = project["services"]
    found = brokers(project)
    assert len(found) >= 2, "several brokers on one Redis"

    def subnets_of(network: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        config = project["networks"][network].get("ipam", {}).get("config", [])
        return [ipaddress.ip_network(c["subnet"]) for c in config]

    subnets = subnets_of("skmq")
    assert subnets and (subnet is None or subnets == [ipaddress.ip_network(subnet)])
    # Redis sits only on a network of its own that recipients cannot be registered on.
    redis_nets = services["redis"]["networks"]
    assert "skmq" not in redis_nets and redis_nets
    store_subnets = [n for net in redis_nets for n in subnets_of(net)]
    assert store_subnets
    logs = set()
    for name, svc in found.items():
        env = environment(svc)
        assert set(env) <= SETTING_NAMES, f"{name}: unknown settings {set(env) - SETTING_NAMES}"
        for key in list(os.environ):
            if key.startswith("SKMQ_"):
                monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings = Settings.load()  # the broker's own validation of the values
        broker_tokens(settings)  # would not refuse to start (auth, or an explicit opt-out)
        assert settings.host == "0.0.0.0"
        host = settings.redis_url.split("//", 1)[1].split(":")[0].split("/")[0]
        assert host in services and services[host]["image"].startswith("redis:")
        assert svc["depends_on"][host]["condition"] == "service_healthy"
        assert settings.metrics_port > 0  # the image's HEALTHCHECK reads /healthz
        networks = [ipaddress.ip_network(n) for n in settings.recipient_networks]
        for net in subnets:
            assert any(net.subnet_of(allowed) for allowed in networks), (name, net)
        for net in store_subnets:
            assert not any(net.overlaps(allowed) for allowed in networks), (name, net)
        assert set(redis_nets) <= set(svc["networks"]), f"{name} cannot reach Redis"
        assert settings.log_format == "json"
        mounts = volume_mounts(svc)
        assert str(settings.delivery_log_dir) in mounts
        logs.add(mounts[str(settings.delivery_log_dir)])
        assert "broker" in svc["networks"]["skmq"]["aliases"]
        assert svc["build"]["target"] == "broker"
    assert len(logs) == 1, "the brokers write their delivery logs to one volume"
    assert len({svc["image"] for svc in found.values()}) == 1


def test_compose_consumer_registers_its_own_address() -> None:
    project = load_compose()
    consumer = project["services"]["consumer"]
    assert consumer["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = consumer["command"]
    words = shlex.split(script)
    assert words[:2] == ["exec", "skmq"]
    # The address is computed by the command substitution at start; stand an IP in.
    substituted = [w for w in words if w.startswith("$(")]
    assert len(substituted) == 1
    inner = shlex.split(substituted[0][2:-1])
    assert inner[:2] == ["python", "-c"]
    compile(inner[2], "<advertise-host>", "exec")
    args = parse_command(["10.173.0.9" if w.startswith("$(") else w for w in words[2:]])
    assert args.subcommand == "consume"
    assert args.advertise_host == "10.173.0.9"
    assert args.host == "0.0.0.0"
    found = brokers(project)
    assert args.broker_host == "broker" or args.broker_host in found
    assert {str(args.broker_port)} == {environment(s)["SKMQ_PORT"] for s in found.values()}
    for name in found:
        assert consumer["depends_on"][name]["condition"] == "service_healthy"
    # The image's HEALTHCHECK probes the broker's /healthz: not a consumer's.
    assert consumer["healthcheck"]["disable"] is True


def test_compose_audit_runs_on_the_spark_cluster() -> None:
    project = load_compose({"SPARK_VERSION": "4.0.9"})
    services = project["services"]
    audit = services["audit"]
    args = parse_command(audit["command"])
    assert args.subcommand == "audit"
    master_url = re.fullmatch(r"spark://([\w-]+):(\d+)", args.master)
    assert master_url, args.master
    master = services[master_url[1]]
    assert "org.apache.spark.deploy.master.Master" in master["command"]
    workers = [
        svc
        for svc in services.values()
        if "org.apache.spark.deploy.worker.Worker" in svc.get("command", [])
    ]
    assert workers and all(args.master in w["command"] for w in workers)
    # The driver's PySpark and the cluster are the same Spark version.
    assert audit["build"]["target"] == "audit"
    assert audit["build"]["args"]["SPARK_VERSION"] == "4.0.9"
    assert master["image"] == "apache/spark:4.0.9"
    assert all(w["image"] == "apache/spark:4.0.9" for w in workers)
    # The driver and the executors read the brokers' delivery logs at one path.
    (logs,) = args.logs
    log_volume = {volume_mounts(b)[logs] for b in brokers(project).values()}
    assert len(log_volume) == 1
    for svc in (audit, *workers):
        assert volume_mounts(svc)[logs] == next(iter(log_volume))
        assert any(v.startswith(f"{next(iter(log_volume))}:{logs}:ro") for v in svc["volumes"])
    assert volume_mounts(audit)[args.out] in project["volumes"]
    # Only on demand: `--profile audit`.
    for svc in (audit, master, *workers):
        assert svc["profiles"] == ["audit"]


# --- the broker image's commands, from a clean virtualenv ---------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(
    cmd: list[str], env: Mapping[str, str], cwd: Path, timeout: float = WAIT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def wait_until(predicate: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"the broker exited ({proc.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"not within {WAIT}s: {what}")


@contextlib.contextmanager
def started(
    cmd: list[str], env: Mapping[str, str], cwd: Path, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(WAIT)


def clean_venv(tmp_path: Path, sources: list[str]) -> Path:
    """A new virtualenv with the package installed as the Dockerfile does it, offline."""
    setuptools_version = _version("setuptools")
    if setuptools_version < (77,):
        pytest.skip(
            f"setuptools {setuptools_version} cannot build this project offline "
            "(PEP 639 `license` needs setuptools>=77): add it to the test extra"
        )
    context = tmp_path / "context"
    context.mkdir()
    for pattern in sources:
        for path in ROOT.glob(pattern):
            if path.is_dir():
                shutil.copytree(
                    path, context / path.name, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy2(path, context / path.name)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=WAIT
    )
    # The dependencies (and pip, setuptools) from this interpreter: a plain path line
    # runs no .pth hook found there, so this project's own editable install stays out.
    parents = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site_packages(venv) / "_parent_deps.pth").write_text("\n".join(parents) + "\n")
    done = run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--ignore-installed",
            "--no-cache-dir",
            "--quiet",
            str(context),
        ],
        {**_base_env(), "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return venv


def site_packages(venv: Path) -> Path:
    (path,) = venv.glob("lib/python3*/site-packages")
    return path


def _version(dist: str) -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in re.findall(r"\d+", version(dist))[:3])


def _base_env() -> dict[str, str]:
    """The environment, less any SKMQ_* setting and Python path of the developer's."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_") and k not in drop}


def test_image_commands_run_from_a_clean_venv(
    tmp_path: Path, dockerfile: tuple[dict[str, str], list[Stage]], broker_chain: list[Stage]
) -> None:
    _, stages = dockerfile
    builder = next(s for s in stages if s.name == "builder")
    venv = clean_venv(tmp_path, copy_sources(builder))
    bin_dir = venv / "bin"
    image_env = env_of(broker_chain)
    env = {
        **_base_env(),
        **{k: v for k, v in image_env.items() if k != "PATH"},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    workdir = tmp_path / "workdir"
    workdir.mkdir()

    where = run(
        [
            "python",
            "-c",
            "import importlib.util, skmq; assert importlib.util.find_spec('skmq.audit_job.audit');"
            " print(skmq.__file__)",
        ],
        env,
        workdir,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), "skmq must come from the clean venv"

    broker = exec_form(broker_chain[-1].last("ENTRYPOINT") or "null")
    broker += exec_form(broker_chain[-1].last("CMD") or "null")
    executable = shutil.which(broker[0], path=str(bin_dir))
    assert executable, f"{broker[0]} is not a console script of the package"
    helped = run([executable, *broker[1:], "--help"], env, workdir)
    assert helped.returncode == 0 and "--redis-url" in helped.stdout, helped.stderr

    # Run the image's command as the image would, but on loopback and free ports.
    port, metrics_port = free_port(), free_port()
    data_dir = tmp_path / "data"
    env |= {
        "SKMQ_HOST": "127.0.0.1",
        "SKMQ_PORT": str(port),
        "SKMQ_METRICS_HOST": "127.0.0.1",
        "SKMQ_METRICS_PORT": str(metrics_port),
        "SKMQ_DATA_DIR": str(data_dir),
        "SKMQ_HEARTBEAT_INTERVAL": "0.5",
        "SKMQ_SHUTDOWN_TIMEOUT": "1",
    }
    healthcheck = broker_chain[-1].last("HEALTHCHECK") or ""
    probe = exec_form(healthcheck.partition("CMD ")[2])

    def healthy() -> bool:
        return run(probe, env, workdir, timeout=10).returncode == 0

    assert not healthy(), "the HEALTHCHECK passes with no broker running"
    with started([executable, *broker[1:]], env, workdir, tmp_path / "broker.log") as proc:
        try:
            wait_until(healthy, "the HEALTHCHECK passes", proc)
            sent = run(
                ["skmq", "send", "--host", "127.0.0.1", "--port", str(port), "--app", "demo", "hi"],
                env,
                workdir,
            )
            assert sent.returncode == 0, sent.stdout + sent.stderr
            # The delivery log lands in <DATA_DIR>/delivery-log: the path compose shares
            # with the audit.
            logs = list((data_dir / "delivery-log").glob("*.jsonl"))
            assert logs and any('"stored"' in p.read_text() for p in logs)
            # Redis stalled: /healthz answers 503 and the HEALTHCHECK fails.
            info = json.loads((data_dir / "redis.json").read_text())
            os.kill(int(info["pid"]), signal.SIGSTOP)
            try:
                wait_until(lambda: not healthy(), "the HEALTHCHECK fails without Redis", proc)
            finally:
                os.kill(int(info["pid"]), signal.SIGCONT)
            # Redis killed: the broker starts it again and the HEALTHCHECK passes again.
            os.kill(int(info["pid"]), signal.SIGKILL)

            def restarted() -> bool:
                now = json.loads((data_dir / "redis.json").read_text())
                return now["pid"] != info["pid"] and healthy()

            wait_until(restarted, "the HEALTHCHECK passes after the broker restarts Redis", proc)
        except BaseException:
            sys.stderr.write((tmp_path / "broker.log").read_text(errors="replace")[-4000:])
            raise
