# The jaxps operator: jaxps_operator and its extra (the SDK's kubernetes client among it). No JAX, no grpc, no numpy
# (import-linter keeps the operator from importing them; `.[operator]` does not install them).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/jaxps/operator:0.1.0 .
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY operator operator
RUN pip install --no-cache-dir --prefix=/install '.[operator]'

FROM python:3.11-slim
COPY --from=build /install /usr/local
USER 65532:65532
ENTRYPOINT ["jaxps"]
CMD ["operator"]
