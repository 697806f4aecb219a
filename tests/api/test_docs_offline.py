"""/docs and /redoc render on a machine without internet: every file they load is the API's own."""

from __future__ import annotations

import re

import httpx
import pytest
from procs import Service

ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")
ANY_URL = re.compile(r"""(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}""")


@pytest.mark.parametrize(("page", "kinds"), [("/docs", {".js", ".css", ".png"}), ("/redoc", {".js", ".png"})])
def test_the_docs_page_names_no_external_url_and_its_assets_load(
    bare_api: Service, client: httpx.Client, page: str, kinds: set[str]
) -> None:
    r = client.get(bare_api.url + page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert ANY_URL.findall(r.text) == [], "the page names a host of its own: it needs internet"
    assets = ASSET.findall(r.text)
    assert {a[a.rindex(".") :] for a in assets} == kinds
    for asset in assets:
        assert asset.startswith("/"), asset
        got = client.get(bare_api.url + asset)
        assert got.status_code == 200 and len(got.content) > 500, asset
    spec = client.get(bare_api.url + "/openapi.json")
    assert spec.status_code == 200 and "/v1/jobs" in spec.json()["paths"]
