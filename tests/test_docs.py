"""/docs and /redoc work in a closed network: every file their pages load comes from the service."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

# What each kind of file must be served as.
CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".png": "image/png",
    ".json": "application/json",
}


class _References(HTMLParser):
    """The URLs a page loads: script src, link href, ReDoc's spec-url."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "spec-url") and value is not None:
                self.urls.append(value)


def _loaded_urls(html: str) -> list[str]:
    parser = _References()
    parser.feed(html)
    # Swagger UI's spec URL is in its inline script: `url: '/openapi.json'`.
    parser.urls += re.findall(r"\burl: '([^']*)'", html)
    return parser.urls


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("/docs", {".js", ".css", ".png", ".json"}),
        ("/redoc", {".js", ".png", ".json"}),
    ],
)
def test_doc_pages_load_only_files_the_service_serves(
    client_no_embedder: TestClient, page: str, expected: set[str]
) -> None:
    r = client_no_embedder.get(page)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    urls = _loaded_urls(r.text)
    assert {url[url.rfind(".") :] for url in urls} == expected, urls
    for url in urls:
        assert re.match(r"/[^/]", url), f"{page} loads {url} from elsewhere"  # a path, no host
        served = client_no_embedder.get(url)
        assert served.status_code == 200, url
        assert served.headers["content-type"].startswith(CONTENT_TYPES[url[url.rfind(".") :]]), (
            url,
            served.headers["content-type"],
        )
        assert len(served.content) > 1000, url  # the real file, not a stub
    assert "cdn" not in r.text.lower()


def test_swagger_ui_is_the_bundle_that_reads_openapi_3_1(client_no_embedder: TestClient) -> None:
    """FastAPI serves OpenAPI 3.1, which Swagger UI renders from version 5 on."""
    (js,) = [u for u in _loaded_urls(client_no_embedder.get("/docs").text) if u.endswith(".js")]
    bundle = client_no_embedder.get(js).text
    assert "SwaggerUIBundle" in bundle
    assert "https://spec.openapis.org/oas/3.1/dialect/base" in bundle
    assert client_no_embedder.get("/openapi.json").json()["openapi"].startswith("3.1")


def test_doc_routes_stay_out_of_the_openapi_document(client_no_embedder: TestClient) -> None:
    paths = set(client_no_embedder.get("/openapi.json").json()["paths"])
    assert not {p for p in paths if p.startswith(("/docs", "/redoc", "/static"))}
