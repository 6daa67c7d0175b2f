"""The shipped OpenAPI document is valid and lists exactly the routes served."""

from __future__ import annotations

from openapi_spec_validator import validate
from tornado import web

from gpubroker.api.app import ROUTES
from gpubroker.api.handlers import load_openapi

HTTP_METHODS = ("get", "post", "put", "patch", "delete")


def served() -> set[tuple[str, str]]:
    routes = set()
    for path, handler in ROUTES:
        for method in HTTP_METHODS:
            if getattr(handler, method) is not getattr(web.RequestHandler, method):
                routes.add((f"/api/v1{path}", method))
    return routes


def documented() -> set[tuple[str, str]]:
    spec = load_openapi()
    return {
        (path, method)
        for path, item in spec["paths"].items()
        for method in item
        if method in HTTP_METHODS
    }


def test_openapi_document_is_valid_3_1() -> None:
    spec = load_openapi()
    assert spec["openapi"].startswith("3.1")
    validate(spec)


def test_openapi_lists_exactly_the_served_routes() -> None:
    assert served() == documented()
