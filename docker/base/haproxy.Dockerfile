# A stand-in for the official haproxy image where Docker Hub cannot be reached: Debian bookworm's HAProxy
# (2.6), laid out as the official image is (configuration in /usr/local/etc/haproxy, user `haproxy`).
ARG DEBIAN_IMAGE=specwhisper-local/debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update \
    && apt-get install -y --no-install-recommends haproxy ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && install -d /usr/local/etc/haproxy \
    && ln -s /usr/sbin/haproxy /usr/local/sbin/haproxy
USER haproxy
STOPSIGNAL SIGUSR1
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
