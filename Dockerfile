# One image for the API and the worker (docker-compose.yml picks the command).
# torch from PyPI is the CUDA build on x86-64, which is what a GPU worker wants; an API-only
# deployment can pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu to stay small.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=""
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
COPY pyproject.toml README.md ./
COPY api ./api
COPY common ./common
COPY workers ./workers
COPY spool_cli ./spool_cli
RUN pip install ".${EXTRAS:+[$EXTRAS]}"

EXPOSE 8000
CMD ["spool", "api", "--host", "0.0.0.0", "--port", "8000"]
