# forgeflow worker image: the Prefect kubernetes worker of the `k8s` work pool AND the image of the
# flow-run Jobs it starts (base-job-template*.json: variable `image`).
#
# Build from the repository root (it needs a registry that serves python:3.11-slim-bookworm):
#   podman build -f infra/k8s/worker.Dockerfile -t REGISTRY/forgeflow/worker:0.1.0 .
#   GPU variant: add --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Run as the worker (ServiceAccount forgeflow-worker, infra/k8s/rbac.yaml):
#   forgeflow work-pool apply --pool k8s   (or: prefect work-pool create k8s --type kubernetes
#   --base-job-template infra/k8s/base-job-template.json; the templates are deployments/work_pool.py's output)
#   (the image's default command then starts the worker on that pool)
FROM python:3.11-slim-bookworm

ARG PREFECT_VERSION=3.9.1
ARG PREFECT_KUBERNETES_VERSION=0.8.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG S3FS_VERSION=2026.9.0

# git/patch: task generation and patch checks; build-essential/cmake: llama-cpp-python builds from source;
# skopeo: the registry flows copy and inspect images with it (forgeflow/registry/skopeo.py). No podman:
# inside the cluster a trial is a pod (forgeflow.sandbox.kubernetes), never a container started here.
RUN apt-get update \
    && apt-get install -y --no-install-recommends git patch build-essential cmake skopeo \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --uid 1000 --user-group --create-home forgeflow

WORKDIR /opt/forgeflow
COPY pyproject.toml README.md ./
COPY forgeflow ./forgeflow
COPY tasks ./tasks
COPY flows ./flows
COPY blocks ./blocks
COPY deployments ./deployments
COPY infra ./infra
COPY prefect.yaml ./
# editable: forgeflow.settings finds infra/ beside the package

# s3fs: the fsspec driver of the result storage block every flow-run pod shares (README: a RemoteFileSystem on
# s3://...); another object store needs its own driver (gcsfs, adlfs) added here
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" \
        "prefect==${PREFECT_VERSION}" "prefect-kubernetes==${PREFECT_KUBERNETES_VERSION}" "s3fs==${S3FS_VERSION}" -e . \
    && python -c "import forgeflow.sandbox.kubernetes, deployments.work_pool, prefect_kubernetes" \
    && python -c "__import__('fsspec').get_filesystem_class('s3')" \
    && skopeo --version

USER 1000:1000
ENV FORGEFLOW_HOME=/home/forgeflow/.forgeflow \
    PREFECT_HOME=/home/forgeflow/.prefect \
    PYTHONUNBUFFERED=1
WORKDIR /home/forgeflow

CMD ["prefect", "worker", "start", "--pool", "k8s", "--type", "kubernetes"]
