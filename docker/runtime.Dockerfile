# The jaxps runtime: what every TrainingJob pod runs (`python -m jaxps_runtime`), with JAX on CPU.
#   docker build -f docker/runtime.Dockerfile -t ghcr.io/jaxps/runtime:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY operator operator
RUN pip install --no-cache-dir --prefix=/install '.[runtime]'

FROM python:3.11-slim
COPY --from=build /install /usr/local
ENV JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 2222 9090
ENTRYPOINT ["python", "-m", "jaxps_runtime"]
