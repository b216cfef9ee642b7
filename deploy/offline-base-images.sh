#!/usr/bin/env bash
# Stand-ins for the base images that the Dockerfile and docker-compose.yml name, for a machine
# that reaches Debian's package mirror but no image registry.
#
# For each image: present locally -> nothing to do; `docker pull` succeeds -> the real image
# is used; only when both fail is a stand-in built from Debian bookworm's packages and tagged
# with the real name. On a machine that can pull the official images this script builds
# nothing, and `docker compose up` pulls them as usual without it.
#
# The stand-ins keep what the stack relies on from the official images:
#   python:3.11-slim-bookworm  python, pip, venv and the Python headers (the fused CPU kernels
#                              compile against them); pip may install system-wide
#   redis:7.0                  redis-server (protected mode off) and redis-cli, working
#                              directory /data, user redis
#   haproxy:2.6                config at /usr/local/etc/haproxy/haproxy.cfg, user haproxy,
#                              bash (the compose healthcheck), SIGUSR1 as the stop signal
# Each carries the label org.chatgate.stand-in=debian-bookworm.
#
# Usage: deploy/offline-base-images.sh   (as root: debootstrap needs it; ~3 min the first time;
#        needs `debootstrap` and a running Docker engine)
set -euo pipefail

MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE="chatgate-stand-in/debian:bookworm"
LABEL="org.chatgate.stand-in=debian-bookworm"

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# True when the image is here or could be pulled: then no stand-in is wanted.
real_image_available() {
  have_image "$1" && return 0
  docker pull -q "$1" >/dev/null 2>&1
}

debian_base() {
  have_image "$BASE" && return 0
  echo "offline-base-images: building $BASE with debootstrap (~3 min)" >&2
  local root
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' RETURN
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import -c 'CMD ["bash"]' -c "LABEL $LABEL" - "$BASE" >/dev/null
}

# build_stand_in NAME: the Dockerfile on standard input, FROM the Debian base.
build_stand_in() {
  echo "offline-base-images: $1 cannot be pulled; building a stand-in from Debian" >&2
  docker build -q --label "$LABEL" -t "$1" - >/dev/null
}

APT_INSTALL='apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
  --no-install-recommends'
APT_CLEAN='rm -rf /var/lib/apt/lists/*'

missing=()
for image in python:3.11-slim-bookworm redis:7.0 haproxy:2.6; do
  real_image_available "$image" || missing+=("$image")
done
[ ${#missing[@]} -eq 0 ] && exit 0
debian_base

for image in "${missing[@]}"; do
  case "$image" in
    python:*) build_stand_in "$image" <<EOF
FROM $BASE
RUN $APT_INSTALL ca-certificates python3.11 python3.11-venv python3.11-dev python3-pip \
 && $APT_CLEAN \
 && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \
 && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV LANG=C.UTF-8
CMD ["python3"]
EOF
    ;;
    redis:*) build_stand_in "$image" <<EOF
FROM $BASE
RUN $APT_INSTALL redis-server redis-tools && $APT_CLEAN \
 && mkdir /data && chown redis:redis /data
WORKDIR /data
VOLUME /data
USER redis
EXPOSE 6379
# as the official image's entrypoint: no protected mode (the container's network is the fence)
ENTRYPOINT ["sh", "-c", "if [ \"\$1\" = redis-server ]; then shift; set -- redis-server --protected-mode no \"\$@\"; fi; exec \"\$@\"", "redis-entrypoint"]
CMD ["redis-server"]
EOF
    ;;
    haproxy:*) build_stand_in "$image" <<EOF
FROM $BASE
RUN $APT_INSTALL haproxy && $APT_CLEAN \
 && mkdir -p /usr/local/etc/haproxy /var/lib/haproxy \
 && chown haproxy:haproxy /var/lib/haproxy
USER haproxy
STOPSIGNAL SIGUSR1
EXPOSE 8000
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
EOF
    ;;
  esac
done
