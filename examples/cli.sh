# The command line (pip install ./clients/python); the service at KP_URL.
export KP_URL=${KP_URL:-http://127.0.0.1:8000}
kp-scoring evaluate examples/trace.json --dry-run
echo "exit code $?"
kp-scoring evaluate examples/trace.json --dry-run --threshold 0.5 --json | grep '"score"'
echo "exit code $?"
kp-scoring cache stats | grep -E '^(size|capacity)'
