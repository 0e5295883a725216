"""`GatewayRoute`: the order every request is handled in, the same on every route.

1. **Authenticate.** A route's auth dependencies (`deps.AUTH_CHECKS`: the API key,
   or an episode's key) run before anything is read or parsed, so a caller with no key
   or the wrong one learns nothing about the route's schema: 401, never a 422.
2. **Text and numbers.** Path and query parameters and the JSON body pass the one rule
   of `agentflow.api.strict_json` (no NUL, no lone surrogates, no NaN or infinities, no
   number literals past what Python converts); a failure is a 422 naming the place.
3. Then FastAPI validates and calls the endpoint as usual.

Every router of the gateway is built with `route_class=GatewayRoute`; a test checks no
route of the app is anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from agentflow.api.deps import AUTH_CHECKS
from agentflow.api.errors import invalid_input_detail
from agentflow.api.strict_json import check_text, parse_json
from agentflow.errors import InvalidInput


class StrictJSONRequest(Request):
    """A request whose `json()` is `strict_json.parse_json`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body())
            except InvalidInput as exc:
                # FastAPI turns anything but an HTTPException raised while it reads the
                # body into a bare 400; this keeps the 422 and the place.
                detail = invalid_input_detail(exc)
                raise HTTPException(status_code=422, detail=detail) from None
        return self._json


def check_parameters(request: Request) -> None:
    """Path and query parameters under the same text rule as bodies."""
    for name, value in request.path_params.items():
        if isinstance(value, str):
            check_text(value, ("path", name))
    for name, value in request.query_params.multi_items():
        check_text(name, ("query",))
        check_text(value, ("query", name))


class GatewayRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        auth = [AUTH_CHECKS[d.dependency] for d in self.dependencies if d.dependency in AUTH_CHECKS]

        async def route(request: Request) -> Response:
            for authenticate in auth:
                authenticate(request)
            check_parameters(request)
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return route
