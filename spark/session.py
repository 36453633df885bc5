"""The audit's SparkSession: any master, extra settings, a reachable driver address.

``build_spark(master, conf=..., driver_memory=...)`` starts (or, under spark-submit,
joins) a session.  In local mode the driver binds 127.0.0.1 (``SPARK_LOCAL_IP``), the
shuffles use twice the cores as partitions and the driver gets 2g (it is also the
executor and caches the parsed events) unless ``driver_memory`` says otherwise.  For a
cluster master (``spark://host:port``, ``k8s://https://host:port``) executors must
reach the driver, so unless ``SPARK_LOCAL_IP`` or ``spark.driver.host`` is given, the
driver advertises the address of this machine's interface that routes to the master
(never 127.0.0.1); on YARN Spark's own choice is kept.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any
from urllib.parse import urlsplit

import psutil
from pyspark.sql import SparkSession

LOCAL_DRIVER_MEMORY = "2g"
# The throughput collector: G1's concurrent threads take CPU from the tasks on a small
# machine (1M events on 2 cores: 2.0 s of GC CPU with G1, 0.9 s with it). Room for the
# class metadata of a whole audit (Spark's classes, each query's generated ones) from the
# start: the default first threshold (21 MB) stopped every audit for a full collection.
DRIVER_JAVA_OPTIONS = ("-XX:+UseParallelGC", "-XX:MetaspaceSize=256m")

# A local audit of less than this much log text runs on HotSpot's quick compiler (C1)
# only: in a short job its optimising compiler (C2) costs more CPU than its faster code
# gives back (1M events, 160 MB, cold on 2 cores: 35 s of C2 compiling, JVM CPU 110 s
# with it, 94 s without), while at 10M the C1 code's slower tasks would cost more.
SMALL_INPUT_BYTES = 400 * 1024 * 1024
QUICK_JIT_OPTIONS = ("-XX:TieredStopAtLevel=1",)
# ... and caches the parsed lines uncompressed (they fit the driver's 2g): 9% less
# executor CPU at 1M events.
SMALL_INPUT_SETTINGS = {"spark.sql.inMemoryColumnarStorage.compressed": "false"}
# Paths a local driver lists without a Spark job (build_spark).
_LIST_IN_DRIVER = 100_000
# Compressed logs: about this many bytes of text a byte (JSON lines under gzip or bzip2).
COMPRESSED_RATIO = 8

# Class data sharing: the JVM maps the classes a start of Spark loads (some 10,000)
# from an archive instead of reading, parsing and verifying each jar's classes again.
# The first audit of a Spark and Java writes it as its JVM exits; SKMQ_AUDIT_CDS=off: none.
CDS_ENV = "SKMQ_AUDIT_CDS"
CDS_DIR_ENV = "SKMQ_AUDIT_CDS_DIR"
_CDS_DUMP_WAIT_S = 120.0
# The classes an audit loads change with its read path: a new value here, and each
# machine writes a new archive (with Arrow's read of 2026-12-01: a cold 1M audit 16.6-17.0
# s on an archive with its classes, 17.6-18.2 s on one written before it).
_CDS_CLASSES = "arrow-read"
# The JVM's own lines about the archive (one it cannot use, classes it leaves out) go
# to stdout: none.
_CDS_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"

__all__ = [
    "CDS_ENV",
    "LOCAL_DRIVER_MEMORY",
    "SMALL_INPUT_BYTES",
    "build_spark",
    "cds_archive",
    "driver_address",
    "input_bytes",
    "is_small",
    "local_cores",
    "parse_conf",
]

# WARN at the root (the level Spark's shell default expects, so it says nothing about
# it); ERROR for the usual start-up noise; build_spark then sets ERROR everywhere.  No
# exception traces unless --debug: a failed task's trace is no line for a user (the
# failure reaches Python, which names it in one line).
_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{yy/MM/dd HH:mm:ss}} %p %c{{1}}: %m%n{trace}
appender.console.layout.alwaysWriteExceptions = {traces}
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
"""


def _temporary_file(prefix: str, suffix: str) -> str:
    """A file removed when Python exits."""
    handle, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(handle)
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _quiet_log4j_file(debug: bool = False) -> str:
    path = _temporary_file("skmq-audit-log4j-", ".properties")
    with open(path, "w", encoding="utf-8") as handle:
        trace = "%ex" if debug else ""
        handle.write(_LOG4J2.format(trace=trace, traces=str(debug).lower()))
    return path


@contextlib.contextmanager
def _stderr_to(path: str | None) -> Iterator[None]:
    """File descriptor 2 on ``path`` meanwhile (None: left alone), so that a process
    started meanwhile (the JVM) writes its stderr there for good."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def _java() -> str | None:
    """The java that Spark's launcher runs: JAVA_HOME's, else the one on the PATH."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def cds_archive() -> str | None:
    """Where the class archive of this Spark and Java is (or goes); None: no archive
    (``SKMQ_AUDIT_CDS=off``, no java found).  Its name holds a digest of both, and of
    _CDS_CLASSES: a new version of either gets an archive of its own (the JVM would
    refuse the old one), and so does a new read path (the old one lacks its classes)."""
    if os.environ.get(CDS_ENV, "on").lower() in ("off", "0", "false", "no"):
        return None
    java = _java()
    if java is None:
        return None
    import pyspark

    st = os.stat(java)
    spark = f"{pyspark.__file__}|{pyspark.__version__}"
    identity = f"{java}|{st.st_size}|{st.st_mtime_ns}|{spark}|{_CDS_CLASSES}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    directory = os.environ.get(CDS_DIR_ENV) or os.path.join(cache, "skmq", "audit-cds")
    return os.path.join(directory, f"spark-{digest}.jsa")


def _cds_options(archive: str | None) -> list[str]:
    """The JVM options that use the archive, or that write it at the JVM's exit (to a
    file of this process, renamed into place by :func:`_finish_cds_dump` once the JVM
    is gone: a JVM starting meanwhile never maps half an archive)."""
    if archive is None:
        return []
    if os.path.isfile(archive):
        return [f"-XX:SharedArchiveFile={archive}", _CDS_QUIET]
    try:
        os.makedirs(os.path.dirname(archive), exist_ok=True)
    except OSError:
        return []
    if not os.access(os.path.dirname(archive), os.W_OK):
        return []
    partial = f"{archive}.{os.getpid()}.tmp"
    atexit.register(_finish_cds_dump, partial, archive)
    return [f"-XX:ArchiveClassesAtExit={partial}", _CDS_QUIET]


def _pyspark_jvm() -> psutil.Process | None:
    """The JVM PySpark started for this process, None if none runs (yet).  PySpark
    starts it as a child process (spark-submit, which execs java) for the application
    ``pyspark-shell`` (which PYSPARK_SUBMIT_ARGS must name too), and keeps it, a stopped
    session's too, until this process exits."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, a zombie
            command = child.cmdline()
            if "org.apache.spark.deploy.SparkSubmit" in command and "pyspark-shell" in command:
                return child
    return None


# How long an interrupted audit's JVM has to end on SIGTERM (its shutdown hooks) before
# it is killed.
_END_WAIT_S = 5.0


def end_jvm(wait_s: float = _END_WAIT_S) -> None:
    """End the JVM PySpark started for this process, if any: SIGTERM (its shutdown hooks
    run), SIGKILL if it is still there after ``wait_s``."""
    jvm = _pyspark_jvm()
    if jvm is None:
        return
    with contextlib.suppress(psutil.Error):
        jvm.terminate()
        try:
            jvm.wait(timeout=wait_s)
        except psutil.TimeoutExpired:
            jvm.kill()
            jvm.wait(timeout=wait_s)


class EndOnSignal:
    """While entered (once the session started: PySpark's SparkContext sets a SIGINT
    handler of its own), SIGINT and SIGTERM end the JVM first, then the process, with
    status 128 + the signal's number (SystemExit); the handlers before are restored on
    exit.

    PySpark's handler cancels every job and raises KeyboardInterrupt at once.  Under a
    query that was running (an adaptive plan waiting for a stage) a thread's
    ``collect()`` then waited for ever, and the exit with it; a py4j call cut in the
    middle ended with py4j's error ("Gateway must be connected ..."), status 1.  With
    the JVM gone first, every call into it fails at once; whatever fails after the
    signal is its doing, and ends as it does."""

    def __init__(self) -> None:
        self.status = 0  # 128 + the signal's number, once one came
        self.saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.status:  # (a second Ctrl-C while the first ends the JVM)
            return
        self.status = 128 + signum
        end_jvm()
        raise SystemExit(self.status)

    def __enter__(self) -> EndOnSignal:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        if self.status and not isinstance(exc, SystemExit):
            raise SystemExit(self.status) from exc


def _finish_cds_dump(partial: str, archive: str) -> None:
    """At Python's exit: end the JVM (SIGTERM: it runs its shutdown hooks and exits, as
    when its stdin closes), wait for it to write the archive, and move the archive into
    place."""
    jvm = _pyspark_jvm()
    try:
        if jvm is not None:
            jvm.terminate()
            jvm.wait(timeout=_CDS_DUMP_WAIT_S)
            if os.path.getsize(partial) > 0:
                os.replace(partial, archive)
    except (OSError, psutil.Error):  # psutil.TimeoutExpired: no archive this time
        pass
    finally:
        _remove(partial)


def input_bytes(paths: Sequence[str]) -> int | None:
    """About how much log text ``paths`` hold (compressed files counted as their text);
    None when a path is remote (its size unknown here)."""
    total = 0
    for path in paths:
        if "://" in path and not path.startswith("file://"):
            return None
        local = path.removeprefix("file://")
        try:
            size = os.path.getsize(local)
        except OSError:
            continue
        total += size * COMPRESSED_RATIO if local.endswith((".gz", ".bz2", ".zst")) else size
    return total


def is_small(input_size: int | None) -> bool:
    """Less than SMALL_INPUT_BYTES of local log text (:func:`input_bytes`): a local
    audit of it runs on the quick compiler, caches uncompressed and keeps its parsed
    lines as rows."""
    return input_size is not None and input_size < SMALL_INPUT_BYTES


def local_cores(master: str | None) -> int | None:
    """Cores of a local master (``None`` means the default ``local[*]``); None if not local."""
    cpus = os.cpu_count() or 2
    if master is None or master == "local[*]":
        return cpus
    found = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", master.strip())
    if found is None:
        return None
    value = found.group(1)
    if value is None:
        return 1
    return cpus if value == "*" else max(1, int(value))


def parse_conf(items: list[str] | None) -> dict[str, str]:
    """``--conf k=v`` arguments as a mapping; ValueError names a malformed one."""
    conf: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--conf {item!r}: expected KEY=VALUE")
        conf[key.strip()] = value
    return conf


def _master_host(master: str) -> tuple[str, int] | None:
    """The host and port a cluster master URL names (None for yarn, local, or none)."""
    url = master.split("://", 1)[1] if master.startswith("k8s://") else master
    if "://" not in url:
        url = "https://" + url if master.startswith("k8s://") else url
    parts = urlsplit(url.split(",")[0])
    if parts.hostname is None:
        return None
    return parts.hostname, parts.port or 7077


def driver_address(master: str) -> str | None:
    """This machine's address on the route to a cluster master, None if none is known.

    A UDP "connect" sends nothing; it only asks the kernel which interface it would use.
    """
    target = _master_host(master)
    if target is None:
        return None
    try:
        infos = socket.getaddrinfo(target[0], target[1], type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def build_spark(
    master: str | None = None,
    *,
    conf: Mapping[str, str] | None = None,
    driver_memory: str | None = None,
    app_name: str = "skmq-audit",
    debug: bool = False,
    input_size: int | None = None,
) -> SparkSession:
    """A quiet SparkSession: ``local[*]`` unless ``master`` (or spark-submit) says otherwise.

    ``conf`` is passed through as ``--conf`` would be (it wins over the defaults here);
    ``driver_memory`` sets ``spark.driver.memory`` (it takes effect only when this call
    starts the JVM, i.e. not under spark-submit, where ``--driver-memory`` does it).
    Unless ``debug``, a JVM this call starts writes its stderr (Spark's log, Java's
    warnings) to a temporary file, and Spark logs no exception traces: a failure reaches
    Python, which names it in one line.  ``input_size`` (:func:`input_bytes`): a local
    JVM this call starts for less than SMALL_INPUT_BYTES runs on the quick compiler only,
    and a local session caches uncompressed.
    """
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # the JVM already runs
    cores = local_cores(master) if (master is not None or not under_submit) else None
    small = is_small(input_size)
    settings: dict[str, str] = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.adaptive.enabled": "true",
    }
    if cores is not None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        settings["spark.sql.shuffle.partitions"] = str(max(2, 2 * cores))
        # The driver lists the files itself: a Spark job lists more than 32 paths by
        # default, which in local mode runs on the same cores and cost 10M events' audit
        # (103 files) a second before its read.
        settings["spark.sql.sources.parallelPartitionDiscovery.threshold"] = str(_LIST_IN_DRIVER)
        # The driver is the executor: room to cache the parsed events (Spark's 1g spills).
        settings["spark.driver.memory"] = LOCAL_DRIVER_MEMORY
        if small:
            settings.update(SMALL_INPUT_SETTINGS)
    elif master is not None and "SPARK_LOCAL_IP" not in os.environ:
        address = None if "spark.driver.host" in (conf or {}) else driver_address(master)
        if address is not None:
            os.environ["SPARK_LOCAL_IP"] = address
            settings["spark.driver.host"] = address
    starts_jvm = not under_submit and _pyspark_jvm() is None
    quick = starts_jvm and cores is not None and small
    if not under_submit:
        settings["spark.driver.extraJavaOptions"] = " ".join(
            [
                *DRIVER_JAVA_OPTIONS,
                *(QUICK_JIT_OPTIONS if quick else ()),
                *(_cds_options(cds_archive()) if starts_jvm else []),
                f"-Dlog4j2.configurationFile=file:{_quiet_log4j_file(debug)}",
            ]
        )
    if driver_memory:
        settings["spark.driver.memory"] = driver_memory
    settings.update(conf or {})
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    log = _temporary_file("skmq-audit-spark-", ".log") if starts_jvm and not debug else None
    with _stderr_to(log):
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
