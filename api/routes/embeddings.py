"""``POST /v1/embeddings``, OpenAI's embeddings on the job queue.

A request is one foreground job (``JobRequest.embed``) on the queue of the model it names, which
must be one a worker embeds with (``/v1/models``' ``capabilities``): stored, fair-shared between
tenants and resumed as any job. Its worker embeds it, with the other embedding jobs it holds,
in one forward, and the job's terminal event carries the vectors. docs/openai.md, "Embeddings".
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.deps import ServicesDep
from api.errors import ApiError
from api.openai_compat.embeddings import EmbeddingRequest, embedding_response
from api.served import check_servable, resolve_model
from api.submission import submit_job, wait_for_job

router = APIRouter(prefix="/v1", tags=["openai"])

JOB_ID_HEADER = "X-Spool-Job-Id"  # as api/routes/openai.py's


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, services: ServicesDep, http: Request) -> Response:
    request = body.to_job_request(services.settings)
    worker = resolve_model(await services.served.get(), body.model, embed=True)
    check_servable(request, worker)
    job = await submit_job(services, request, worker.model)
    headers = {JOB_ID_HEADER: job.id}
    try:
        done = await wait_for_job(services, job.id, http)
        log = await services.store.read_log(job.id)
        return JSONResponse(embedding_response(done, request, worker.model, log), headers=headers)
    except ApiError as e:
        e.headers.update(headers)
        raise
