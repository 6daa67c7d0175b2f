"""The REST API v1 (Tornado), its authentication and its OpenAPI document."""
