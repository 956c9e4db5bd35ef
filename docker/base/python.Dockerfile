# A stand-in for python:3.11-slim-bookworm where Docker Hub cannot be reached: Debian bookworm's Python 3.11
# (`python` and `python3`, venv, pip, the C headers as in the official image), on the Debian base that
# docker/build-local.sh imports from debootstrap.
ARG DEBIAN_IMAGE=specwhisper-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python-is-python3 libpython3.11-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
