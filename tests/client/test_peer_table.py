"""docs/service.md's table against vLLM's and llama.cpp's servers, held to the code: its "here"
column says what the HTTP front routes and how it classes each request field."""
from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("starlette")

from starlette.routing import Match  # noqa: E402

from nanovllm_client.http import schema  # noqa: E402
from nanovllm_client.http.app import Settings, build_app  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "service.md"


def _rows(marker: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each body row of the table after `<!-- marker -->`."""
    table = DOC.read_text(encoding="utf-8").split(f"<!-- {marker} -->\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    assert rows and all(len(r) == 4 for r in rows), f"the {marker} table has rows of 4 cells"
    return [(r[0], r[1]) for r in rows]


def _routed(app, method: str, path: str) -> bool:
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    return any(route.matches(scope)[0] == Match.FULL for route in app.routes)


def test_every_endpoint_row_says_what_the_front_routes():
    app = build_app(client=None, settings=Settings())
    listed = set()
    for cell, here in _rows("peer-endpoints"):
        method, path = re.fullmatch(r"`(GET|POST) (/\S*)`", cell).groups()
        listed.add((method, path))
        supported = here.startswith("supported")
        assert supported or here.startswith("not served"), (cell, here)
        assert _routed(app, method, path.replace("{id}", "some-model")) == supported, (cell, here)
    routes = {(m, r.path.replace("{name:path}", "{id}")) for r in app.routes for m in r.methods - {"HEAD"}}
    assert routes <= listed, f"routes the table does not list: {sorted(routes - listed)}"


def test_every_field_row_says_how_the_front_classes_the_field():
    mapped = schema.CHAT_FIELDS | schema.COMPLETION_FIELDS
    classes = {"supported": mapped, "accepted and ignored": schema.IGNORED,
               "refused unless null or neutral": set(schema.NEUTRAL)}
    ignored_listed = set()
    for cell, here in _rows("peer-fields"):
        kind = next((k for k in classes if here.startswith(k)), None)
        assert kind is not None, (cell, here)
        names = re.findall(r"`(\w+)`", cell)
        assert names and {n for n in names if n not in classes[kind]} == set(), (kind, cell)
        if kind == "accepted and ignored":
            ignored_listed |= set(names)
    assert ignored_listed == schema.IGNORED
