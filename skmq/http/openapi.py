"""The OpenAPI 3.1 document served at /openapi.json: paths written here, the message
schemas generated from the pydantic models the gateway validates with."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from skmq import __version__
from skmq.console import PEEK_MAX
from skmq.http.connections import MODELS as CONNECTION_MODELS
from skmq.http.console import MODELS as CONSOLE_MODELS
from skmq.http.dlq import MODELS as DLQ_MODELS
from skmq.http.produce import BatchResult, MessageBatch, OutgoingMessage, StoreResult
from skmq.http.pull import MODELS as PULL_MODELS
from skmq.http.recipients import MODELS as RECIPIENT_MODELS

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    why = {
        400: "invalid request (the error says which field)",
        401: "no token, or an unknown one (auth on)",
        403: "the token lacks the role for this app",
        404: "no such group, or a msgid given that is no dead letter (nothing done)",
        408: "body not complete within FRAME_TIMEOUT",
        413: "body, batch or content too large",
        415: "not application/json",
        422: "a mandatory message for an app with no recipient and no consumer group "
        "(nothing of the request stored)",
        500: "a fault of the broker (the traceback is in its log, never here)",
        503: "store unavailable or its disk nearly full (nothing acknowledged; a produce may "
        "be stored: resend with the same msgid), too many long polls, or too many "
        "connections: try again",
    }
    headers = {
        401: ("WWW-Authenticate", 'Bearer realm="skmq"'),
        503: ("Retry-After", "seconds to wait before trying again (1)"),
    }
    out = {str(c): _json(_ref("Error"), why[c]) for c in codes}
    for code, (name, text) in headers.items():
        if str(code) in out:
            header = {"description": text, "schema": {"type": "string"}}
            out[str(code)]["headers"] = {name: header}
    return out


def document() -> dict[str, Any]:
    _, defs = models_json_schema(
        [
            (m, "validation")
            for m in (
                OutgoingMessage,
                MessageBatch,
                StoreResult,
                BatchResult,
                *PULL_MODELS,
                *DLQ_MODELS,
                *RECIPIENT_MODELS,
                *CONNECTION_MODELS,
                *CONSOLE_MODELS,
            )
        ],
        ref_template=_REF,
    )
    schemas: dict[str, Any] = dict(defs["$defs"])
    schemas["Error"] = {
        "type": "object",
        "properties": {"error": {"type": "string"}},
        "required": ["error"],
    }
    app_param = {
        "name": "app",
        "in": "path",
        "required": True,
        "description": "the app id (at most 256 bytes, no control characters)",
        "schema": {"type": "string", "minLength": 1},
    }
    produce = {
        "post": {
            "operationId": "produce",
            "summary": "Store one message or a batch; answered once stored",
            "parameters": [app_param],
            "security": [{"bearer": []}, {}],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"oneOf": [_ref("OutgoingMessage"), _ref("MessageBatch")]}
                    }
                },
            },
            "responses": {
                "200": _json(
                    {"oneOf": [_ref("StoreResult"), _ref("BatchResult")]},
                    "stored (or a duplicate of a msgid stored before): one result each",
                ),
                **_errors(400, 401, 403, 408, 413, 415, 422, 500, 503),
            },
        }
    }
    group_param = {
        "name": "group",
        "in": "path",
        "required": True,
        "description": "the consumer group: 1 to 64 letters, digits, '_', '.' or '-'",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
    }

    def op(
        op_id: str, summary: str, body: str | None, ok: str, ok_why: str, *codes: int
    ) -> dict[str, Any]:
        """An operation answering 200 `ok`, or an Error: 400 (a bad app id, body or
        parameter), 401/403 (auth on), 500, 503, with a body 408/413/415, and `codes`."""
        spec: dict[str, Any] = {
            "operationId": op_id,
            "summary": summary,
            "security": [{"bearer": []}, {}],
        }
        common = [400, 401, 403, 500, 503, *codes]
        if body is not None:
            common += [408, 413, 415]
            content = {"application/json": {"schema": _ref(body)}}
            spec["requestBody"] = {"required": True, "content": content}
        spec["responses"] = {"200": _json(_ref(ok), ok_why), **_errors(*sorted(set(common)))}
        return spec

    create_group = op(
        "createGroup",
        "Subscribe a consumer group (201 created, 200 exists)",
        "NewGroup",
        "GroupCreated",
        "the group existed already (created false)",
    )
    create_group["responses"] = {
        "201": _json(_ref("GroupCreated"), "the group was created (created true)"),
        **create_group["responses"],
    }
    receive = op("receive", "Up to max messages, each leased for visibility seconds; waits "
                 "up to wait seconds for one", "ReceiveRequest", "ReceiveResult",
                 "the messages (none when the wait ran out)", 404)  # fmt: skip
    receive["requestBody"]["required"] = False  # (none: every field's default)
    on_group = {"parameters": [app_param, group_param]}
    pull_paths: dict[str, Any] = {
        "/v1/apps/{app}/groups": {
            "parameters": [app_param],
            "get": op("listGroups", "The app's consumer groups", None, "GroupList",
                      "each group with its backlog"),
            "post": create_group,
        },
        "/v1/apps/{app}/groups/{group}": {
            **on_group,
            "delete": op("deleteGroup", "Delete a group (admin role)", None, "GroupDeleted",
                         "deleted", 404),
        },
        "/v1/apps/{app}/groups/{group}/reset": {
            **on_group,
            "post": op("resetGroup", "Move a group to latest, earliest or a time (admin role)",
                       "GroupReset", "GroupPosition", "where the group reads from now", 404),
        },
        "/v1/apps/{app}/groups/{group}/receive": {**on_group, "post": receive},
        "/v1/apps/{app}/groups/{group}/ack": {
            **on_group,
            "post": op("ack", "Settle received messages by receipt", "AckRequest",
                       "ReceiptResults", "acked, or stale (another attempt, lease ran out)",
                       404),
        },
        "/v1/apps/{app}/groups/{group}/nack": {
            **on_group,
            "post": op("nack", "A failed attempt: retried after delay (or the backoff), "
                       "dead after RETRY_TIMES", "NackRequest", "ReceiptResults",
                       "retry, dead, or stale", 404),
        },
        "/v1/apps/{app}/groups/{group}/extend": {
            **on_group,
            "post": op("extend", "Lease received messages for visibility more seconds",
                       "ExtendRequest", "ReceiptResults", "extended, or stale", 404),
        },
    }  # fmt: skip
    limit_param = {
        "name": "limit", "in": "query", "required": False,
        "description": "at most this many, oldest first (default 1000)",
        "schema": {"type": "integer", "minimum": 1, "maximum": 100000},
    }  # fmt: skip
    group_param = {
        "name": "group", "in": "query", "required": False,
        "description": "the dead letters of this consumer group (absent: of the pushes)",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
    }  # fmt: skip
    dlq_paths: dict[str, Any] = {
        "/v1/apps/{app}/dlq": {
            "parameters": [app_param],
            "get": {**op("listDeadLetters", "The app's dead letters (admin role)", None,
                         "DeadLetterList", "oldest first"),
                    "parameters": [limit_param, group_param]},
        },
        "/v1/apps/{app}/dlq/replay": {
            "parameters": [app_param],
            "post": op("replayDeadLetters", "Replay dead letters (filters, dry run, into "
                       "another app; admin role)", "DlqRequest", "DlqResult",
                       "what was selected and done", 404),
        },
        "/v1/apps/{app}/dlq/purge": {
            "parameters": [app_param],
            "post": op("purgeDeadLetters", "Delete dead letters (filters, dry run; admin role)",
                       "DlqRequest", "DlqResult", "what was selected and done", 404),
        },
    }  # fmt: skip
    app_query = {
        "name": "app", "in": "query", "required": False,
        "description": "only this app (absent: every app the token has the admin role for)",
        "schema": {"type": "string", "minLength": 1},
    }  # fmt: skip
    id_param = {
        "name": "id", "in": "path", "required": True,
        "description": "the recipient's id (at most 256 characters, no control characters)",
        "schema": {"type": "string", "minLength": 1},
    }  # fmt: skip
    operator_paths: dict[str, Any] = {
        "/v1/recipients": {
            "get": {**op("listRecipients", "Registered recipients, alive or lost (admin role)",
                         None, "RecipientList", "each recipient with its state"),
                    "parameters": [app_query]},
        },
        "/v1/apps/{app}/recipients/{id}": {
            "parameters": [app_param, id_param],
            "delete": op("removeRecipient", "Remove a recipient gone for good, as its "
                         "unregister would (admin role)", None, "RecipientRemoved",
                         "removed, or it was not registered (removed false)"),
        },
        "/v1/connections": {
            "get": op("listConnections", "Producers, push links and pull polls of every live "
                      "broker (admin role)", None, "ConnectionList", "the connections"),
        },
    }  # fmt: skip
    peek_params = [
        {"name": "max", "in": "query", "required": False,
         "description": "at most this many, oldest first (default 100)",
         "schema": {"type": "integer", "minimum": 1, "maximum": PEEK_MAX}},
        {"name": "dead", "in": "query", "required": False,
         "description": "1: the dead letters instead of the messages waiting",
         "schema": {"type": "string", "enum": ["0", "1"]}},
    ]  # fmt: skip
    console_paths: dict[str, Any] = {
        "/v1/apps": {
            "get": op("listApps", "Every app the token is admin of: depths, recipients, "
                      "groups, rates over the last minute", None, "AppList", "the apps"),
        },
        "/v1/apps/{app}/purge": {
            "parameters": [app_param],
            "post": op("purgeWaiting", "Delete messages waiting (not in flight, not dead), "
                       "oldest first (dry run; admin role)", "PurgeRequest", "PurgeResult",
                       "what was purged (on a dry run: would be)"),
        },
    }  # fmt: skip
    produce["get"] = {
        **op("peek", "The messages waiting, oldest first, or the dead letters; nothing "
             "changes (admin role)", None, "MessageList", "oldest first"),
        "parameters": [app_param, *peek_params],
    }  # fmt: skip
    text = {"text/plain": {"schema": {"type": "string"}}}
    # Any route: one connection too many is refused before routing (skmq/http/guard.py).
    crowded = _errors(503)["503"]["content"]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "SKMQ HTTP gateway",
            "version": __version__,
            "description": "Produce to SKMQ over HTTP (docs/HTTP.md).",
        },
        "paths": {
            "/v1/apps/{app}/messages": produce,
            **pull_paths,
            **dlq_paths,
            **operator_paths,
            **console_paths,
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {"description": "Prometheus text", "content": text},
                        "503": {"description": "too many connections", "content": crowded},
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "summary": "Health: ok, degraded (200) or unhealthy (503), one line why",
                    "responses": {
                        "200": {"description": "serving", "content": text},
                        "503": {
                            "description": "not serving (text), or too many connections",
                            "content": {**text, **crowded},
                        },
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1 document",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "503": {"description": "too many connections", "content": crowded},
                    },
                }
            },
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a token of AUTH_TOKEN or AUTH_FILE (docs/SECURITY.md)",
                }
            },
        },
    }
