"""The asynchronous routes: ``POST /v2/jobs``, ``GET /v2/jobs/{id}`` and
``Prefer: respond-async`` on ``/v2/models/{m}/infer``.

A submission is checked as the synchronous route checks it (the codec names a bad
field, the model its wrong input: 4xx at once, not a failed job later), stored
compactly in the job stream (:mod:`slipstream.jobs.queue`) and answered 202 with the
job's status and ``Location: /v2/jobs/<id>``. A client may name the job with an
``Idempotency-Key`` header: submitting the same key again returns that job.

    curl -X POST localhost:8000/v2/models/add_sub/infer -H 'Prefer: respond-async' -d @req.json
    -> 202 {"job_id":"9f3c...","status":"pending",...}
    curl localhost:8000/v2/jobs/9f3c...
    -> 200 {"job_id":"9f3c...","status":"done",...,"result":{"model_name":"add_sub",...}}
"""

from __future__ import annotations

from slipstream.errors import InvalidRequest, NotFound
from slipstream.jobs.codec import encode_status, encode_stored_request
from slipstream.jobs.queue import JobQueue, new_job_id
from slipstream.names import check_job_id, path_model_name
from slipstream.protocol import v2
from slipstream.server.httpd import HttpRequest, HttpResponse
from slipstream.serving.service import InferenceService

_IDEMPOTENCY_KEY = b"idempotency-key"
_PREFER = b"prefer"
_HEADER_LENGTH = b"inference-header-content-length"
_NOT_ENABLED = (
    "asynchronous jobs are not enabled on this server; start it with "
    "--jobs-redis redis://host:port and run `slipstream worker`s on the same Redis"
)


def prefers_async(request: HttpRequest) -> bool:
    """Whether the request's ``Prefer`` header (RFC 7240) asks for ``respond-async``."""
    prefer = request.header(_PREFER)
    if prefer is None:
        return False
    return any(
        token.split(b"=", 1)[0].strip().lower() == b"respond-async" for token in prefer.split(b",")
    )


class JobRoutes:
    """The job routes of one server; ``queue`` None answers them 404 (not enabled)."""

    def __init__(self, service: InferenceService, queue: JobQueue | None) -> None:
        self._service = service
        self._queue = queue

    @property
    def enabled(self) -> bool:
        return self._queue is not None

    async def submit_named(self, http: HttpRequest) -> HttpResponse:
        """``POST /v2/jobs``: a V2 inference request whose ``model`` field (and optional
        ``model_version``) names what to run."""
        self._require_queue()
        doc = v2.load_json_object(self._json_part(http))
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest(
                f"model: expected the name of the model to run, got {model!r}; e.g. "
                '{"model": "add_sub", "inputs": [...]}'
            )
        version = doc.get("model_version", "")
        if not isinstance(version, str) or not (version == "" or version.isdigit()):
            raise InvalidRequest(
                f"model_version: expected a version number as a string, got {version!r}"
            )
        return await self.submit(path_model_name(model), version, http, preferred=False)

    async def submit(
        self, model: str, version: str, http: HttpRequest, preferred: bool = True
    ) -> HttpResponse:
        """Check and store one job; 202 with its status."""
        queue = self._require_queue()
        key = http.header(_IDEMPOTENCY_KEY)
        job_id = new_job_id() if key is None else check_job_id(key.decode("latin-1"))
        request = v2.decode_infer_request(http.body, self._header_length(http), model, version)
        if request.shared_memory_inputs or any(
            out.shared_memory is not None for out in request.outputs or ()
        ):
            raise InvalidRequest(
                "shared_memory_region: a job runs later, on another host: send its tensors "
                "in the request, not in a shared-memory region"
            )
        await self._service.check(request)
        body, header_length = encode_stored_request(request)
        submitted = await queue.submit(job_id, model, version, body, header_length)
        status = await queue.status(submitted.job_id)
        headers = [(b"location", f"/v2/jobs/{submitted.job_id}".encode())]
        if preferred:
            headers.append((b"preference-applied", b"respond-async"))
        reply = encode_status(status) if status is not None else b"{}"
        return HttpResponse(202, reply, b"application/json", headers)

    async def status(self, job_id: str) -> HttpResponse:
        """``GET /v2/jobs/{id}``: 200 with the job's status (and result), 404 unknown."""
        queue = self._require_queue()
        status = await queue.status(check_job_id(job_id, "job id"))
        if status is None:
            raise NotFound(
                f"job {job_id!r} not found: it was never submitted, or it ended longer ago "
                "than the workers' --result-ttl-s"
            )
        return HttpResponse(200, encode_status(status))

    def _require_queue(self) -> JobQueue:
        if self._queue is None:
            raise NotFound(_NOT_ENABLED)
        return self._queue

    def _header_length(self, http: HttpRequest) -> int | None:
        header = http.header(_HEADER_LENGTH)
        if header is None:
            return None
        if not header.strip().isdigit():
            raise InvalidRequest(
                f"header Inference-Header-Content-Length: {header.decode('latin-1')!r} is "
                "not a non-negative integer"
            )
        return int(header)

    def _json_part(self, http: HttpRequest) -> bytes:
        length = self._header_length(http)
        return http.body if length is None else http.body[:length]
