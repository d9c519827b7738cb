"""``/v1/files``: upload (multipart, ``purpose=batch``), list, get, content, delete."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchgen.service.errors import APIError, missing_parameter, not_found
from batchgen.service.objects import file_object, list_object
from batchgen.service.params import query_int
from batchgen.service.runtime import Service

_MAX_FILENAME = 255


def add_file_routes(app: FastAPI, svc: Service) -> None:
    store = svc.store

    @app.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        try:
            form = await request.form(max_files=1, max_fields=8)
        except (APIError, StarletteHTTPException):
            raise  # 413 from GuardMiddleware, 400 from Starlette's multipart parser
        except Exception as err:  # anything else the multipart parser may raise
            raise APIError(
                400, f"the body must be multipart/form-data ({err})", code="invalid_request"
            ) from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise missing_parameter("file", "the batch input, a multipart/form-data file part")
            if purpose is None:
                raise missing_parameter("purpose", '"batch"')
            if purpose != "batch":
                raise APIError(
                    400,
                    f"'purpose' must be \"batch\" (the only purpose BatchGen serves), "
                    f"got {purpose!r}",
                    param="purpose",
                    code="invalid_purpose",
                )
            if upload.size is not None and upload.size > svc.config.max_upload_bytes:
                raise APIError(
                    413,
                    f"file too large: {upload.size} bytes, the limit is "
                    f"{svc.config.max_upload_bytes} bytes",
                    code="file_too_large",
                )
            filename = Path(upload.filename or "upload.jsonl").name[:_MAX_FILENAME]
            row = await run_in_threadpool(store.create_file, upload.file, filename, "batch")
        finally:
            await form.close()
        return JSONResponse(file_object(row))

    @app.get("/v1/files")
    def list_files(request: Request) -> dict:
        purpose = request.query_params.get("purpose")
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(
                400,
                f'\'order\' must be "asc" or "desc", got {order!r}',
                param="order",
                code="invalid_order",
            )
        limit = query_int(request, "limit", 10000, 1, 10000)
        rows, more = store.list_files(
            purpose=purpose, limit=limit, order=order, after=request.query_params.get("after")
        )
        return list_object([file_object(r) for r in rows], more)

    def _file(file_id: str) -> dict:
        row = store.get_file(file_id)
        if row is None:
            raise not_found("File", file_id)
        return row

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: str) -> dict:
        return file_object(_file(file_id))

    @app.get("/v1/files/{file_id}/content")
    def get_file_content(file_id: str) -> FileResponse:
        path = store.blob_path(_file(file_id)["id"])
        if not path.exists():  # deleted meanwhile
            raise not_found("File", file_id)
        return FileResponse(path, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str) -> dict:
        if not store.delete_file(file_id):
            raise not_found("File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}
