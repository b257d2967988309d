"""TGI's HTTP face: routes, request validation, SSE, errors, metrics and the OpenAPI document."""
