"""What a request no route answers gets: 405 only where another method would do."""

from __future__ import annotations

from slipstream.errors import MethodNotAllowed, NotFound
from slipstream.server.router import no_route


def test_another_method_of_a_route_is_405_with_allow() -> None:
    refused = no_route("GET", "/v2/models/m/infer")
    assert isinstance(refused, MethodNotAllowed) and refused.allow == ["POST"]


def test_a_route_asked_with_its_own_method_but_not_mounted_is_404() -> None:
    """Under Ray with no generative model nothing mounts /v1: a GET of /v1/models used to
    answer "GET is not allowed on /v1/models; use GET, HEAD"."""
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        refused = no_route(method, path)
        assert type(refused) is NotFound, refused
        assert refused.message == f"{method} {path} is not served here"
    assert no_route("GET", "/nowhere").message == "no route for GET /nowhere"
