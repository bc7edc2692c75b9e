#!/usr/bin/env bash
# deploy/install-criu.sh - idempotent install of CRIU >= 4.2 and pycriu for snapshotter.
#
#   sudo deploy/install-criu.sh [--python PATH] [--smoke] [--force] [--prefix DIR]
#
# Result, on every supported machine:
#   /opt/snapshotter/criu/bin/criu        exec wrapper; the one criu path the product uses
#   /opt/snapshotter/criu/python/pycriu   pycriu package (only that; no other Debian modules)
#   <site-packages of --python>/snapshotter-pycriu.pth   makes the directory above importable
#   /usr/local/sbin/criu -> the wrapper   only when no criu >= 4.2 is already on PATH
#
# Why 4.2: Linux 6.16 restricted SO_PASSCRED/SO_PASSSEC to unix, netlink and bluetooth
#   sockets, and CRIU 4.1 reads them from every socket, so it cannot dump a process holding
#   any TCP socket on current kernels (criu commit 4b73985, in 4.2). Debian 12's criu 3.17
#   does not even start on them ("Unexpected rt vDSO area bounds"), and Debian 13 ships 4.1.1.
# So on Debian 12 and 13 alike, Debian forky's criu, libcompel1, python3-pycriu and their whole
#   library closure (forky's libc6 included) are downloaded with a PRIVATE apt configuration
#   (own sources list, lists, cache, empty dpkg status; the system's apt sources, lists and
#   installed packages are never touched), unpacked with `dpkg -x` under the prefix, and criu
#   is started through that prefix's own dynamic loader. Mirror URIs and keyrings are derived
#   from the machine's apt configuration (no host name is written here); Release signatures
#   are always verified.
#
# pycriu as shipped by Debian may read FieldDescriptor.label, which protobuf >= 7 removed
# (pycriu.images.* -> AttributeError). The private copy gets the upstream fix backported
# (checkpoint-restore/criu PR #3008) where it is missing; the RPC part works as is.

set -Eeuo pipefail

DEFAULT_PREFIX=/opt/snapshotter/criu
PREFIX=$DEFAULT_PREFIX
PTH_NAME=snapshotter-pycriu.pth
SBIN_LINK=/usr/local/sbin/criu
MIN_MAJOR=4
MIN_MINOR=2
# A testing suite: no -updates, and its security fixes arrive in the suite itself.
TARGET_SUITE=forky
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

PYTHON=""
SMOKE=0
FORCE=0

log()  { printf '[install-criu] %s\n' "$*"; }
warn() { printf '[install-criu] WARNING: %s\n' "$*" >&2; }
die()  { printf '[install-criu] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "[install-criu] ERROR: command failed (exit %s) at line %s: %s\n" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

usage() {
    sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --python PATH   interpreter that must be able to import pycriu (default: python3 on PATH)
  --smoke         also dump a throwaway 'sleep' process through pycriu (deploy/criu_smoke.py)
  --force         re-download and re-install even if a working criu >= 4.2 is installed
  --prefix DIR    install there instead of /opt/snapshotter/criu (no /usr/local/sbin link);
                  point SNAPSHOTTER_CRIU at DIR/bin/criu to use it
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || die "--python needs a path"; PYTHON=$2; shift 2 ;;
        --python=*) PYTHON=${1#--python=}; shift ;;
        --smoke) SMOKE=1; shift ;;
        --force) FORCE=1; shift ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $1" ;;
    esac
done

WRAPPER="$PREFIX/bin/criu"
PYDIR="$PREFIX/python"

# ---------------------------------------------------------------------------------------------
# helpers

# criu_version BIN -> prints "MAJOR.MINOR[.SUB]" or nothing
criu_version() {
    "$1" --version 2>/dev/null | sed -n 's/^Version:[[:space:]]*\([0-9][0-9.]*\).*/\1/p' | head -n1
}

# version_ok X.Y[.Z] -> true if >= MIN_MAJOR.MIN_MINOR
version_ok() {
    local v=$1 major minor
    major=${v%%.*}; minor=${v#*.}; minor=${minor%%.*}
    [[ $major =~ ^[0-9]+$ && $minor =~ ^[0-9]+$ ]] || return 1
    [ "$major" -gt "$MIN_MAJOR" ] || { [ "$major" -eq "$MIN_MAJOR" ] && [ "$minor" -ge "$MIN_MINOR" ]; }
}

wrapper_ok() {
    [ -x "$WRAPPER" ] && [ -d "$PYDIR/pycriu" ] || return 1
    local v; v=$(criu_version "$WRAPPER")
    [ -n "$v" ] && version_ok "$v"
}

# Backport of checkpoint-restore/criu PR #3008 into a private pycriu copy: protobuf >= 7
# removed FieldDescriptor.label. No-op if the file does not use field.label.
patch_pb2dict() {
    local f=$1/pycriu/images/pb2dict.py
    [ -f "$f" ] || die "pycriu copy has no images/pb2dict.py ($f)"
    if grep -q 'field\.label == FD\.LABEL_REPEATED' "$f"; then
        sed -i 's/field\.label == FD\.LABEL_REPEATED/_is_repeated(field)/g' "$f"
        cat >>"$f" <<'EOF'


def _is_repeated(field):
    # snapshotter (deploy/install-criu.sh): backport of checkpoint-restore/criu PR #3008.
    # protobuf >= 7 removed FieldDescriptor.label; is_repeated only exists in newer versions.
    if hasattr(field, "label"):
        return field.label == FD.LABEL_REPEATED
    return field.is_repeated
EOF
        log "patched pycriu/images/pb2dict.py for protobuf >= 7 (criu PR #3008 backport)"
    fi
}

# ---------------------------------------------------------------------------------------------
# platform

[ "$(id -u)" -eq 0 ] || die "must run as root (installs under $PREFIX and /usr/local/sbin)"
[ -r /etc/debian_version ] || die "/etc/debian_version not found: only Debian 12 and 13 are supported"
command -v dpkg >/dev/null && command -v apt-get >/dev/null || die "dpkg/apt-get not found"

DEBVER=$(cat /etc/debian_version)
CODENAME=$( . /etc/os-release 2>/dev/null; echo "${VERSION_CODENAME:-}" )
case "$DEBVER" in
    12|12.*|bookworm*) DEBIAN=12 ;;
    13|13.*|trixie*)   DEBIAN=13 ;;
    *) die "unsupported Debian version '$DEBVER' (codename '${CODENAME:-?}'): supported are Debian 12 and 13" ;;
esac
ARCH=$(dpkg --print-architecture)
case "$ARCH" in
    amd64) TRIPLET=x86_64-linux-gnu;  LDSO=ld-linux-x86-64.so.2 ;;
    arm64) TRIPLET=aarch64-linux-gnu; LDSO=ld-linux-aarch64.so.1 ;;
    *) die "unsupported architecture '$ARCH' (supported: amd64, arm64)" ;;
esac
log "Debian $DEBVER (treated as Debian $DEBIAN), arch $ARCH, kernel $(uname -r)"

# Python interpreter that must import pycriu (an explicit one is checked now; the default
# python3 is looked up after the install, which on Debian 13 may have brought it in)
if [ -n "$PYTHON" ]; then
    if [ -x "$PYTHON" ] && [ ! -d "$PYTHON" ]; then :
    elif command -v "$PYTHON" >/dev/null; then PYTHON=$(command -v "$PYTHON")
    else die "--python '$PYTHON' is not an executable interpreter"
    fi
fi

# ---------------------------------------------------------------------------------------------
# forky packages, private apt configuration, private prefix (Debian 12 and 13)

# Prints "URI SUITE SIGNED-BY" for every enabled "deb" entry of the machine's apt sources.
list_apt_sources() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        awk '
            function flush(   n, m, i, j, U, S) {
                if (types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") {
                    n = split(uris, U, /[ \t]+/); m = split(suites, S, /[ \t]+/)
                    for (i = 1; i <= n; i++) for (j = 1; j <= m; j++)
                        if (U[i] != "" && S[j] != "") print U[i], S[j], (signed == "" ? "-" : signed)
                }
                types = uris = suites = signed = enabled = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]/   { next }   # continuation line (e.g. an inline Signed-By key): ignored
            {
                k = $0; sub(/:.*/, "", k); k = tolower(k)
                v = $0; sub(/^[^:]*:[ \t]*/, "", v); sub(/[ \t]+$/, "", v)
                if (k == "types") types = v; else if (k == "uris") uris = v
                else if (k == "suites") suites = v; else if (k == "enabled") enabled = tolower(v)
                else if (k == "signed-by") { split(v, A, /[ \t,]+/); signed = A[1] }
            }
            END { flush() }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        awk '
            $1 == "deb" {
                i = 2; opts = ""
                if ($2 ~ /^\[/) { while (i <= NF) { opts = opts " " $i; if ($i ~ /\]$/) { i++; break } i++ } }
                signed = "-"
                if (match(opts, /signed-by=[^] \t]+/)) signed = substr(opts, RSTART + 10, RLENGTH - 10)
                if (i + 1 <= NF) print $i, $(i + 1), signed
            }' "$f"
    done
}

install_private() {
    command -v dpkg-deb >/dev/null || die "dpkg-deb not found"
    local host=${CODENAME:-bookworm}
    local entries main_uri="" main_key="" sec_uri="" sec_key="" uri suite key
    entries=$(list_apt_sources)
    while read -r uri suite key; do
        [ -n "$uri" ] || continue
        case "$uri" in cdrom:*|file:*|copy:*) continue ;; esac
        uri=${uri%/}
        case "$suite" in
            "$host")          [ -n "$main_uri" ] || { main_uri=$uri; main_key=$key; } ;;
            "$host-security") [ -n "$sec_uri" ]  || { sec_uri=$uri;  sec_key=$key; } ;;
        esac
    done <<<"$entries"
    [ -n "$main_uri" ] || die "no enabled 'deb ... $host' entry found in /etc/apt/sources.list{,.d/*}: cannot derive the Debian mirror for $TARGET_SUITE"

    # keyring: the entry's Signed-By if it is a keyring file, else Debian's archive keyring
    local default_key=/usr/share/keyrings/debian-archive-keyring.gpg
    [ -f "$main_key" ] || main_key=$default_key
    [ -z "$sec_uri" ] || [ -f "$sec_key" ] || sec_key=$default_key
    [ -f "$main_key" ] || die "no keyring to verify $TARGET_SUITE with ($main_key missing; install debian-archive-keyring)"

    W=$(mktemp -d /tmp/snapshotter-criu-apt.XXXXXX)
    trap 'rm -rf "$W"' EXIT
    chmod 0755 "$W"   # apt's download sandbox user (_apt) must reach $W/debs
    mkdir -p "$W/state/lists/partial" "$W/cache/archives/partial" "$W/etc/sources.list.d" \
             "$W/etc/preferences.d" "$W/debs" "$W/root"
    : >"$W/state/status"
    APTOPT=(-o "Dir::State=$W/state" -o "Dir::State::Lists=$W/state/lists"
            -o "Dir::State::status=$W/state/status" -o "Dir::Cache=$W/cache"
            -o "Dir::Cache::archives=$W/cache/archives"
            -o "Dir::Etc::SourceList=$W/etc/sources.list" -o "Dir::Etc::SourceParts=$W/etc/sources.list.d"
            -o "Dir::Etc::Preferences=$W/etc/preferences" -o "Dir::Etc::PreferencesParts=$W/etc/preferences.d"
            -o "APT::Architecture=$ARCH" -o "APT::Install-Recommends=false")
    if id _apt >/dev/null 2>&1; then chown -R _apt:root "$W/state/lists/partial" "$W/cache/archives/partial" "$W/debs"; fi

    write_sources() {  # $1: keyring for the main mirror, $2: for the security mirror
        echo "deb [signed-by=$1] $main_uri $TARGET_SUITE main" >"$W/etc/sources.list"
        log "private apt sources ($W/etc/sources.list):"
        sed 's/^/    /' "$W/etc/sources.list"
    }
    private_update() {
        rm -rf "$W/state/lists"; mkdir -p "$W/state/lists/partial"
        if id _apt >/dev/null 2>&1; then chown _apt:root "$W/state/lists/partial"; fi
        apt-get "${APTOPT[@]}" update >"$W/update.log" 2>&1 || { cat "$W/update.log"; return 1; }
        cat "$W/update.log"
        # apt exits 0 on some signature problems; treat any of them as failure
        ! grep -Eq 'NO_PUBKEY|EXPKEYSIG|REVKEYSIG|BADSIG|is not signed|could not be verified|couldn.t be verified' "$W/update.log"
    }

    write_sources "$main_key" "$sec_key"
    log "apt-get update (private lists only, signatures verified)"
    if ! private_update; then
        # The keyring does not cover trixie (debian-archive-keyring older than 2023.3+deb12u2?).
        # Get the newest debian-archive-keyring of the host's own suite, verified with the keyring
        # the host already trusts, and use its keyring for trixie. Verification stays on.
        warn "could not verify $TARGET_SUITE with $main_key; fetching the newest $host debian-archive-keyring (verified with the host's keyring)"
        {
            echo "deb [signed-by=$main_key] $main_uri $host main"
            echo "deb [signed-by=$main_key] $main_uri $host-updates main"
            [ -z "$sec_uri" ] || echo "deb [signed-by=$sec_key] $sec_uri $host-security main"
        } >"$W/etc/sources.list"
        sed 's/^/    /' "$W/etc/sources.list"
        private_update || die "apt-get update of the host's own suites failed; cannot obtain a keyring for $TARGET_SUITE"
        (cd "$W/debs" && apt-get "${APTOPT[@]}" download debian-archive-keyring) \
            || die "could not download debian-archive-keyring"
        dpkg -x "$W"/debs/debian-archive-keyring_*.deb "$W/keyring"
        rm -f "$W"/debs/debian-archive-keyring_*.deb
        local k=$W/keyring/usr/share/keyrings/debian-archive-keyring.gpg
        [ -f "$k" ] || die "debian-archive-keyring package has no $k"
        log "using the keyring of debian-archive-keyring $(apt-cache "${APTOPT[@]}" policy debian-archive-keyring | sed -n 's/^ *Candidate: //p') for $TARGET_SUITE"
        write_sources "$k" "$k"
        private_update || die "cannot verify the $TARGET_SUITE archive signatures even with the newest $host debian-archive-keyring; refusing to continue without verification"
    fi

    # dependency closure of criu (+ libcompel1), resolved by apt against an empty dpkg status
    log "resolving criu's dependency closure in $TARGET_SUITE"
    local sim pkgs=() criu_ver="" p v
    sim=$(apt-get "${APTOPT[@]}" -s install criu libcompel1) || { echo "$sim"; die "apt could not resolve criu in $TARGET_SUITE"; }
    while read -r p v; do
        pkgs+=("$p=$v")
        [ "$p" != criu ] || criu_ver=$v
    done < <(printf '%s\n' "$sim" | sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*/\1 \2/p')
    [ -n "$criu_ver" ] || die "criu not in the resolved set (apt output above)"
    # pycriu is pure Python: the package alone (its python3/python3-protobuf deps are not used)
    pkgs+=("python3-pycriu=$criu_ver")
    log "packages (${#pkgs[@]}): ${pkgs[*]}"

    log "downloading (apt verifies each .deb against the signed indexes)"
    (cd "$W/debs" && apt-get "${APTOPT[@]}" download "${pkgs[@]}") || die "apt-get download failed"

    local stage="$PREFIX.new.$$" deb
    rm -rf "$stage"; mkdir -p "$stage/bin" "$stage/python"
    log "unpacking into $stage (dpkg -x; nothing is registered with the system's dpkg)"
    for deb in "$W"/debs/*.deb; do
        dpkg -x "$deb" "$stage"
        dpkg-deb --show --showformat='${Package} ${Version}\n' "$deb" >>"$stage/MANIFEST"
    done
    local libpath="$PREFIX/usr/lib/$TRIPLET:$PREFIX/lib/$TRIPLET"
    [ -x "$stage/usr/lib/$TRIPLET/$LDSO" ] || die "the $TARGET_SUITE libc6 did not provide usr/lib/$TRIPLET/$LDSO"
    [ -x "$stage/usr/sbin/criu" ] || die "criu package did not provide usr/sbin/criu"
    cat >"$stage/bin/criu" <<EOF
#!/bin/sh
# generated by deploy/install-criu.sh: Debian $TARGET_SUITE criu $criu_ver, run by
# its own glibc through the prefix's dynamic loader. exec keeps pid and inherited fds
# (\`criu swrk <fd>\`) untouched. --inhibit-cache: never fall back to the host's ld.so.cache.
exec "$PREFIX/usr/lib/$TRIPLET/$LDSO" --inhibit-cache --argv0 criu \\
    --library-path "$libpath" "$PREFIX/usr/sbin/criu" "\$@"
EOF
    chmod 0755 "$stage/bin/criu"
    [ -d "$stage/usr/lib/python3/dist-packages/pycriu" ] || die "python3-pycriu did not provide usr/lib/python3/dist-packages/pycriu"
    cp -a "$stage/usr/lib/python3/dist-packages/pycriu" "$stage/python/pycriu"
    patch_pb2dict "$stage/python"

    # every library criu loads must come from the prefix, never from the host
    log "checking that criu resolves all its libraries inside the prefix"
    local listing
    listing=$("$stage/usr/lib/$TRIPLET/$LDSO" --inhibit-cache --library-path "$stage/usr/lib/$TRIPLET:$stage/lib/$TRIPLET" \
                  --list "$stage/usr/sbin/criu" 2>&1) \
        || { echo "$listing"; die "the loader cannot resolve criu's libraries (output above)"; }
    echo "$listing" | sed 's/^/    /'
    if echo "$listing" | grep '=>' | grep -v "=> $stage/" | grep -q .; then
        die "criu resolves libraries outside the prefix (see above): the dependency closure is incomplete"
    fi
    swap_in "$stage"
}

# swap_in STAGE: atomically-ish replace $PREFIX with STAGE
swap_in() {
    local stage=$1 old="$PREFIX.old.$$"
    if [ -e "$PREFIX" ]; then mv "$PREFIX" "$old"; fi
    mv "$stage" "$PREFIX"
    rm -rf "$old"
    log "installed into $PREFIX"
}

# ---------------------------------------------------------------------------------------------
# main

mkdir -p "$(dirname "$PREFIX")"
if [ "$FORCE" -eq 0 ] && wrapper_ok; then
    log "criu $(criu_version "$WRAPPER") already installed at $WRAPPER: skipping download (--force to reinstall)"
else
    if [ "$FORCE" -eq 1 ]; then log "--force: reinstalling"
    elif [ -e "$WRAPPER" ]; then log "existing $WRAPPER is not a working criu >= $MIN_MAJOR.$MIN_MINOR with pycriu: reinstalling"
    else log "no $WRAPPER yet: installing"; fi
    install_private
fi

VER=$(criu_version "$WRAPPER")
[ -n "$VER" ] || { "$WRAPPER" --version || true; die "$WRAPPER --version did not report a version"; }
version_ok "$VER" || die "$WRAPPER is criu $VER, need >= $MIN_MAJOR.$MIN_MINOR"
log "criu version via $WRAPPER: $VER"

# /usr/local/sbin/criu -> wrapper, only if PATH has no criu >= 4.2 yet
existing=$(command -v criu || true)
if [ "$PREFIX" != "$DEFAULT_PREFIX" ]; then
    log "prefix $PREFIX: no $SBIN_LINK link (SNAPSHOTTER_CRIU=$WRAPPER selects it)"
elif [ -L "$SBIN_LINK" ] && [ "$(readlink "$SBIN_LINK")" = "$WRAPPER" ]; then
    log "$SBIN_LINK -> $WRAPPER already present"
elif [ -n "$existing" ] && version_ok "$(criu_version "$existing")"; then
    log "criu $(criu_version "$existing") already on PATH at $existing: not creating $SBIN_LINK"
elif [ -e "$SBIN_LINK" ] || [ -L "$SBIN_LINK" ]; then
    warn "$SBIN_LINK exists and is not ours (a criu < $MIN_MAJOR.$MIN_MINOR or broken): leaving it alone; use $WRAPPER"
else
    mkdir -p "$(dirname "$SBIN_LINK")"
    ln -s "$WRAPPER" "$SBIN_LINK"
    log "created $SBIN_LINK -> $WRAPPER${existing:+ (shadows $existing)}"
fi
case ":$PATH:" in *":$(dirname "$SBIN_LINK"):"*) ;; *) warn "$(dirname "$SBIN_LINK") is not on PATH here" ;; esac

# criu check
log "running: $WRAPPER check   ('rlimit: Can't setup RLIMIT_NOFILE' lines are harmless)"
CHECK_RC=0
CHECK_OUT=$("$WRAPPER" check 2>&1) || CHECK_RC=$?
echo "$CHECK_OUT" | sed 's/^/    /'
[ "$CHECK_RC" -eq 0 ] || die "criu check failed (exit $CHECK_RC): the kernel or environment lacks what criu needs (output above)"
log "criu check: OK"

# pycriu for the chosen interpreter
if [ -z "$PYTHON" ]; then
    PYTHON=$(command -v python3 || true)
    [ -n "$PYTHON" ] || warn "no python3 on PATH and no --python given: pycriu is installed in $PYDIR but not wired into any interpreter"
fi
if [ -n "$PYTHON" ]; then
    SITE=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
        || die "cannot ask $PYTHON for its site-packages"
    mkdir -p "$SITE"
    if [ "$(cat "$SITE/$PTH_NAME" 2>/dev/null)" != "$PYDIR" ]; then
        printf '%s\n' "$PYDIR" >"$SITE/$PTH_NAME"
        log "wrote $SITE/$PTH_NAME -> $PYDIR"
    else
        log "$SITE/$PTH_NAME already points to $PYDIR"
    fi
    log "verifying pycriu with $PYTHON"
    "$PYTHON" - <<'EOF' || die "pycriu does not import/work under $PYTHON (needs 'protobuf' from PyPI in that environment)"
import sys
import google.protobuf
import pycriu
import pycriu.rpc_pb2 as rpc
from pycriu.images import pb2dict
req = rpc.criu_req(type=rpc.DUMP)
req.opts.images_dir_fd = 3
req.opts.pid = 1
back = rpc.criu_req.FromString(req.SerializeToString())
assert back.opts.pid == 1 and back.type == rpc.DUMP
d = pb2dict.pb2dict(back)
assert d["opts"]["pid"] == 1, d
print("    pycriu %s from %s; protobuf %s; rpc round-trip + pb2dict OK"
      % (pycriu.__version__, pycriu.__file__, google.protobuf.__version__))
EOF
else
    warn "no interpreter: skipped the pycriu wiring"
fi

if [ "$SMOKE" -eq 1 ]; then
    [ -n "$PYTHON" ] || die "--smoke needs a Python interpreter (--python PATH)"
    log "smoke test: $PYTHON $SCRIPT_DIR/criu_smoke.py --criu $WRAPPER"
    "$PYTHON" "$SCRIPT_DIR/criu_smoke.py" --criu "$WRAPPER" || die "pycriu smoke test failed (output above)"
fi

log "done: criu $VER at $WRAPPER"
