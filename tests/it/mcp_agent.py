"""An agent's session with steamrf's /mcp, through the official MCP Python SDK.

Run by the end-to-end test `an_agent_uses_memory_through_mcp` (tests/it/main.rs)
against a real `steamrf serve` and `steamrf run`. It lists the tools, calls each,
checks results and refusals (401 before MCP, 403 as a tool error, bad arguments),
and prints a transcript (the one in docs/agents.md). Exits non-zero on the first
failed check.

Usage: mcp_agent.py URL USER WRITER_TOKEN OTHER_TENANT_TOKEN ADMIN_TOKEN
"""

import asyncio
import contextlib
import json
import sys
import time

import httpx2
from mcp import ClientSession, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

URL, USER, WRITER, OTHER, ADMIN = sys.argv[1:6]


def show(label, value):
    print(f"--- {label}")
    print(json.dumps(value, indent=2, ensure_ascii=False) if not isinstance(value, str) else value)
    sys.stdout.flush()


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)


@contextlib.asynccontextmanager
async def connect(token, statuses):
    """An initialised-later MCP session with a bearer token; every HTTP status
    the server answers is appended to `statuses`."""

    async def record(response):
        statuses.append(response.status_code)

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with create_mcp_http_client(headers=headers) as http:
        http.event_hooks["response"].append(record)
        async with streamable_http_client(URL, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                yield session


def mcp_error(e):
    """The MCPError inside `e` (the SDK raises it through task groups)."""
    if isinstance(e, MCPError):
        return e
    for inner in getattr(e, "exceptions", ()):
        found = mcp_error(inner)
        if found is not None:
            return found
    return None


def payload(result):
    """A tool result's structured content (also sent as its text)."""
    check(result.structured_content is not None, "a tool result carries structured content")
    text = json.loads(result.content[0].text)
    check(text == result.structured_content, "the text content is the structured content")
    return result.structured_content


async def main():
    # 401 before MCP: no token, and an unknown one.
    for token in (None, "not-a-token-0123456789"):
        statuses = []
        try:
            async with connect(token, statuses) as session:
                await session.initialize()
            check(False, "initialize without a valid token must fail")
        except Exception as raised:  # noqa: BLE001 - the SDK raises through task groups
            e = mcp_error(raised)
            check(e is not None, f"an MCPError, not {raised!r}")
            show(f"initialize with token={token!r}: refused", {"http_status": statuses, "error": e.error.message})
            check(statuses == [401], f"the server answered 401 (saw {statuses})")
            check("bearer token" in e.error.message, e.error.message)

    statuses = []
    async with connect(WRITER, statuses) as session:
        init = await session.initialize()
        show("initialize", {"server": init.server_info.name, "protocol": init.protocol_version,
                            "instructions": init.instructions})
        check(init.server_info.name == "steamrf", "the server names itself")

        tools = (await session.list_tools()).tools
        show("tools/list", [{"name": t.name, "description": t.description,
                             "input": sorted(t.input_schema.get("properties", {})),
                             "required": t.input_schema.get("required", [])} for t in tools])
        names = sorted(t.name for t in tools)
        check(names == ["forget", "recommend", "remember", "retrieve"], names)
        by_name = {t.name: t for t in tools}
        check(by_name["retrieve"].annotations.read_only_hint is True, "retrieve is read-only")
        check(by_name["forget"].annotations.destructive_hint is True, "forget is destructive")
        for t in tools:
            props = t.input_schema["properties"]
            check(all(p.get("description") for p in props.values()),
                  f"every argument of {t.name} is described for the model")

        # remember a turn, then retrieve it, and time it.
        text = "My sister Ada plays the bassoon in the Lisbon orchestra"
        args = {"user_id": USER, "text": text, "session_id": "agent-1"}
        sent = time.monotonic()
        r = await session.call_tool("remember", args)
        show("tools/call remember " + json.dumps(args), r.structured_content)
        check(not r.is_error, r.content)
        event_id = payload(r)["event_id"]
        check(event_id.startswith("mcp-"), event_id)

        query = {"user_id": USER, "query": "what instrument does Ada play?", "k": 3,
                 "mode": "familiarity"}
        while True:
            r = await session.call_tool("retrieve", query)
            check(not r.is_error, r.content)
            hits = payload(r)["items"]
            # The turn's own row: its session (memories quote it too).
            if any(text in h["content"] and h["kind"] in ("session", "dialogue") for h in hits):
                break
            check(time.monotonic() - sent < 10, f"the turn was not retrievable within 10 s: {hits}")
            await asyncio.sleep(0.05)
        answered = time.monotonic() - sent
        out = payload(r)
        show("tools/call retrieve " + json.dumps(query), out)
        print(f"remember -> retrievable in {answered:.2f} s", file=sys.stderr)
        hit = next(h for h in out["items"]
                   if text in h["content"] and h["kind"] in ("session", "dialogue"))
        check(hit["provenance"]["source_event_ids"] == [event_id], hit["provenance"])
        check(hit["provenance"]["table"] == "interactions", hit["provenance"])
        check(out["explanation"]["path"] == "familiarity", out["explanation"])

        # The adaptive default, with the gate's explanation.
        r = await session.call_tool("retrieve", {"user_id": USER, "query": "bebop records"})
        check(not r.is_error, r.content)
        check(payload(r)["explanation"]["path"] in ("familiarity", "recollection"), r.content)

        # An interaction, then recommend.
        r = await session.call_tool("remember", {"user_id": USER, "item_id": "jazz5",
                                                   "action": "purchase"})
        show("tools/call remember an interaction", r.structured_content)
        check(not r.is_error, r.content)
        args = {"user_id": USER, "candidates": ["space0", "jazz2", "no-such-item"], "k": 3}
        r = await session.call_tool("recommend", args)
        show("tools/call recommend " + json.dumps(args), r.structured_content)
        check(not r.is_error, r.content)
        ranked = payload(r)["ranked"]
        check([x["item_id"] for x in ranked] == ["jazz2", "space0", "no-such-item"], ranked)
        check(all(x["reason"] for x in ranked), ranked)

        # Refusals a model reads: tool errors with the API's error object.
        r = await session.call_tool("retrieve", {"user_id": USER, "query": "  "})
        show("tools/call retrieve with a blank query", r.structured_content)
        check(r.is_error and payload(r)["error"]["status"] == 400, r.content)
        check(payload(r)["error"]["field"] == "query", r.content)
        r = await session.call_tool("remember", {"user_id": USER})
        check(r.is_error and payload(r)["error"]["field"] == "text", r.content)
        r = await session.call_tool("forget", {"user_id": USER})
        show("tools/call forget with a tenant token", r.structured_content)
        check(r.is_error and payload(r)["error"]["status"] == 403, r.content)
        check(payload(r)["error"]["code"] == "forbidden", r.content)
        # A wrong argument type is the protocol's invalid params.
        try:
            r = await session.call_tool("retrieve", {"user_id": USER, "query": 7})
            check(r.is_error, f"a numeric query must be refused: {r}")
            show("tools/call retrieve with query=7", r.content[0].text)
        except MCPError as e:
            show("tools/call retrieve with query=7", {"code": e.error.code, "message": e.error.message})
        check(all(code in (200, 202) for code in statuses), statuses)

    async with connect(OTHER, []) as session:
        await session.initialize()
        r = await session.call_tool("retrieve", {"user_id": USER, "query": "bassoon"})
        show("tools/call retrieve with another tenant's token", r.structured_content)
        check(r.is_error and payload(r)["error"]["status"] == 403, r.content)
        r = await session.call_tool("remember", {"user_id": USER, "text": "x"})
        check(r.is_error and payload(r)["error"]["status"] == 403, r.content)
        check(payload(r)["error"]["field"] == "user_id", r.content)

    # An admin forgets the user; their rows disappear.
    async with connect(ADMIN, []) as session:
        await session.initialize()
        r = await session.call_tool("forget", {"user_id": USER})
        show(f"tools/call forget {{\"user_id\": \"{USER}\"}} with an admin token", r.structured_content)
        check(not r.is_error, r.content)
        sent = time.monotonic()
        while True:
            r = await session.call_tool("retrieve", query)
            check(not r.is_error, r.content)
            if not any(text in h["content"] for h in payload(r)["items"]):
                break
            check(time.monotonic() - sent < 30, "the user was not forgotten within 30 s")
            await asyncio.sleep(0.2)
        show("tools/call retrieve after forget", payload(r)["items"])
        print(f"forget -> gone in {time.monotonic() - sent:.2f} s", file=sys.stderr)
    print("OK")


asyncio.run(main())
