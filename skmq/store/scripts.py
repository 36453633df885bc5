"""The Lua scripts behind every state change: one `.lua` file a transition, in
`skmq/store/lua/` (the transitions are listed in `skmq/lifecycle.py`).

Each script gets every key it touches in KEYS, in the order `KEYS` below names them
(each name is under the app's key base; `done:<b>` buckets are appended by the caller),
so Redis Cluster and proxies can route it: all of one app's keys share the app's hash
tag, and no script touches a key of another app or of the whole store (the apps
directory is kept outside the scripts: skmq/store/directory.py). The
helpers of `lib.lua` it uses (and, for fail and reap, the retry policy of `retry.lua`)
are prepended to a script when it is loaded.
"""

from __future__ import annotations

import functools
import re
from importlib import resources

# The app keys each script touches, in KEYS order.
KEYS: dict[str, tuple[str, ...]] = {
    "store": (  # + done:<current>, done:<previous>
        *("msgs", "ready", "delayed", "listed", "groups", "glog", "gseen", "recipients"),
        *("state", "kq", "gadded"),
    ),
    "claim": ("msgs", "state", "ready", "delayed", "inflight", "dead", "rate", "kq"),
    "fail": ("msgs", "state", "delayed", "inflight", "dead", "ready", "kq"),
    "reap": ("msgs", "state", "delayed", "inflight", "dead", "ready", "kq"),
    "finish": ("msgs", "state", "inflight", "ready", "delayed", "kq"),  # + done:<current>
    "extend": ("msgs", "state", "inflight"),
    "release": ("msgs", "state", "ready", "delayed", "inflight"),
    "in_flight_of": ("msgs", "state", "inflight"),
    "holding": ("msgs",),
    "stored_of": ("msgs",),  # + done:<current>, done:<previous>
    "settled_of": ("msgs", "inflight", "delayed", "dead"),  # + done:<cur>, done:<prev>
    "replay": ("state", "delayed", "dead"),
    "purge": ("msgs", "state", "dead"),
    # an operator's (skmq/console.py): look at, or purge, the messages waiting
    "peek": ("msgs", "state", "ready", "delayed", "kq"),
    "purge_waiting": ("msgs", "state", "ready", "delayed", "kq"),
    "oldest_pending": ("msgs", "ready", "delayed"),
    # the source app's; Store.move adds the target app's msgs, ready, listed, done:*
    "move": ("msgs", "state", "dead"),
    "set_state": ("recipients", "rstate", "rbeat"),
    "register": ("recipients", "rstate", "rbeat", "listed", "tally"),
    "unregister": ("recipients", "rstate", "rbeat"),
    "forget": (
        *("ready", "delayed", "inflight", "dead", "recipients"),  # checked empty
        *("msgs", "state", "rstate", "rbeat", "rate", "listed"),  # dropped
        "groups",  # checked empty
        "tally",  # dropped
    ),
    # Consumer groups (skmq/pull/): + the group's inflight, delayed, held, gstate, dead, kq.
    # group_create and group_reset: + gadded, after them.
    "group_create": ("groups", "glog"),
    "group_reset": ("groups", "glog"),
    "group_delete": ("groups", "glog"),
    "group_trim": ("groups", "glog", "gseen", "gadded"),  # + each group's held
    "pull_receive": ("groups", "glog"),
    "pull_ack": ("groups", "glog"),
    "pull_nack": ("groups", "glog"),
    "pull_extend": ("groups", "glog"),
    "pull_replay": ("groups", "glog"),
    "pull_purge": ("groups", "glog"),
}

_PRELUDES: dict[str, tuple[str, ...]] = {
    "group_create": ("group_position",),
    "group_reset": ("group_position",),
    "fail": ("retry",),
    "reap": ("retry",),
    **{
        name: ("pull_lib",)
        for name in (
            *("pull_receive", "pull_ack", "pull_nack", "pull_extend"),
            *("pull_replay", "pull_purge"),
        )
    },
}


def _read(name: str) -> str:
    return resources.files("skmq.store").joinpath("lua", f"{name}.lua").read_text("utf-8")


# A top-level definition of lib.lua: `local function name(` or `local name =`.
_DEFINITION = re.compile(r"^local (?:function )?(\w+)", re.MULTILINE)
_COMMENT = re.compile(r"--[^\n]*")
# lib.lua's paragraphs start after a blank line, at a comment or a definition (a blank
# line inside a function is followed by indented code).
_PARAGRAPH = re.compile(r"\n\n(?=--|local )")


def _paragraphs(lib: str) -> list[tuple[set[str], str]]:
    """lib.lua cut into paragraphs, each with the names it defines."""
    return [(set(_DEFINITION.findall(p)), p + "\n\n") for p in _PARAGRAPH.split(lib)]


def _used(code: str, names: set[str]) -> set[str]:
    words = set(re.findall(r"\w+", _COMMENT.sub("", code)))
    return names & words


def lib_for(code: str, lib: str | None = None) -> str:
    """The paragraphs of lib.lua (or of `lib`, another such file's text) defining what
    `code` uses, directly or through another, in file order: Redis runs a script's whole
    prelude on every call (each helper a new closure, more for Lua's collector to sweep),
    so a script carries only what it calls."""
    paragraphs = _paragraphs(_read("lib") if lib is None else lib)
    names = set().union(*(defined for defined, _ in paragraphs))
    needed = _used(code, names)
    for defined, text in reversed(paragraphs):  # a helper calls only those above it
        if defined & needed:
            needed |= _used(text, names - defined)
    return "".join(text for defined, text in paragraphs if defined & needed)


@functools.cache
def source(name: str) -> str:
    """The full source of script `name`: the lib.lua helpers it uses, its preludes, then
    its own file (built once a process: every Store registers every script)."""
    own = "\n".join([*(_read(p) for p in _PRELUDES.get(name, ())), _read(name)])
    return lib_for(own) + "\n" + own
