"""The batch job service (``batchgen serve``): OpenAI Files/Batches API over one background
engine, a durable SQLite job store, and `BatchGenClient`.

Modules: `store` (SQLite WAL + blob files), `jobs` (validation and finalization of batches),
`engine_loop` (the engine thread), `app` (FastAPI routes), `streaming` (SSE chunks),
`errors` (OpenAI error objects), `metrics` (Prometheus), `server` (uvicorn), `client`
(`BatchGenClient`, httpx only). Only `client` is light to import; the rest needs the
service dependencies (fastapi, uvicorn, prometheus_client, python-multipart).
"""
