"""The Lua scripts behind every state change: one `.lua` file a transition, in
`skmq/store/lua/` (the transitions are listed in `skmq/lifecycle.py`).

Each script gets every key it touches in KEYS, in the order `KEYS` below names them
(each name is under the app's key base; `done:<b>` buckets are appended by the caller),
so Redis Cluster and proxies can route it: all of one app's keys share the app's hash
tag, and no script touches a key of another app or of the whole store (the apps
directory is kept outside the scripts: skmq/store/directory.py). The
helpers of `lib.lua` (and, for fail and reap, the retry policy of `retry.lua`) are
prepended to a script when it is loaded.
"""

from __future__ import annotations

from importlib import resources

# The app keys each script touches, in KEYS order.
KEYS: dict[str, tuple[str, ...]] = {
    "store": (  # + done:<current>, done:<previous>
        *("msgs", "ready", "delayed", "listed", "groups", "glog", "gseen", "recipients"),
        *("state", "kq"),
    ),
    "claim": ("msgs", "state", "ready", "delayed", "inflight", "dead", "rate", "kq"),
    "fail": ("msgs", "state", "delayed", "inflight", "dead", "ready", "kq"),
    "reap": ("msgs", "state", "delayed", "inflight", "dead", "ready", "kq"),
    "finish": ("msgs", "state", "inflight", "ready", "delayed", "kq"),  # + done:<current>
    "extend": ("msgs", "state", "inflight"),
    "release": ("msgs", "state", "ready", "delayed", "inflight"),
    "in_flight_of": ("msgs", "state", "inflight"),
    "replay": ("state", "delayed", "dead"),
    "purge": ("msgs", "state", "dead"),
    # the source app's; Store.move adds the target app's msgs, ready, listed, done:*
    "move": ("msgs", "state", "dead"),
    "set_state": ("recipients", "rstate", "rbeat"),
    "register": ("recipients", "rstate", "rbeat", "listed"),
    "unregister": ("recipients", "rstate", "rbeat"),
    "forget": (
        *("ready", "delayed", "inflight", "dead", "recipients"),  # checked empty
        *("msgs", "state", "rstate", "rbeat", "rate", "listed"),  # dropped
    ),
    # Consumer groups (skmq/pull/): + the group's inflight, delayed, held, gstate, dead.
    "group_create": ("groups", "glog"),
    "group_reset": ("groups", "glog"),
    "group_delete": ("groups", "glog"),
    "group_trim": ("groups", "glog", "gseen"),  # + each group's held
    "pull_receive": ("groups", "glog"),
    "pull_ack": ("groups", "glog"),
    "pull_nack": ("groups", "glog"),
    "pull_extend": ("groups", "glog"),
}

_PRELUDES: dict[str, tuple[str, ...]] = {
    "fail": ("retry",),
    "reap": ("retry",),
    **{name: ("pull_lib",) for name in ("pull_receive", "pull_ack", "pull_nack", "pull_extend")},
}


def _read(name: str) -> str:
    return resources.files("skmq.store").joinpath("lua", f"{name}.lua").read_text("utf-8")


def source(name: str) -> str:
    """The full source of script `name`: lib.lua, its preludes, then its own file."""
    parts = [_read("lib"), *(_read(p) for p in _PRELUDES.get(name, ())), _read(name)]
    return "\n".join(parts)
