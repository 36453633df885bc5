#!/bin/sh
# The install step of SKMQ's images, and the one place it is written: docker/Dockerfile
# runs it for each image, and tests/test_docker.py runs the same on the host, so that
# what the test starts is what the image holds.
#
#   sh docker/install.sh EXTRA VENV [REQUIREMENT ...]
#
# Makes a new virtualenv VENV and installs into it the package of this repository (the
# directory above this script) with its extra EXTRA, resolving every dependency from
# the package index:
#   server  the broker and the operator commands (`skmq serve`, `skmq status`, ...)
#   audit   the Spark audit (`skmq audit`: PySpark; Java comes from the image)
# REQUIREMENT: more pip requirements, resolved together with the package, e.g.
# "pyspark==4.0.1" to pin the audit driver's PySpark to the Spark cluster's version.
# PYTHON: the interpreter the virtualenv is made with (default: python3).
set -eu

usage="usage: sh docker/install.sh server|audit VENV [REQUIREMENT ...]"
if [ "$#" -lt 2 ]; then
    echo "$usage" >&2
    exit 2
fi
extra=$1
venv=$2
shift 2
case $extra in
    server | audit) ;;
    *)
        echo "install.sh: no extra '$extra' ($usage)" >&2
        exit 2
        ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install "$root[$extra]" "$@"
