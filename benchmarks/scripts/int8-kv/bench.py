# A/B TTFT of a 2,048-token prompt through 1P+1D, int8 vs bf16 KV cache, alternating.
import json, random, re, subprocess, sys, time, urllib.request, statistics
from tokenizers import Tokenizer
FISSION = '/work/main/target/release/fission'
tok = Tokenizer.from_file('/tmp/int8-kv-model/tokenizer.json')
words = ['the','cat','sat','on','a','mat','and','looked','at','little','girl','who','was','happy','dog','ran','park','sun','tree','big']

def prompt(i):
    # A distinct first word per request: no prefix-cache hits across runs.
    random.seed(100 + i)
    ws = [f'n{i}'] + [random.choice(words) for _ in range(1400)]
    ids = tok.encode(' '.join(ws)).ids
    # Cut to 2,047 tokens of text (+ BOS = 2,048).
    return tok.decode(ids[:2047]), None

def up(dtype, log):
    port = {'int8': '18931', 'bf16': '18932'}[dtype]
    p = subprocess.Popen([FISSION, 'up', '--port', port, '--model', '/tmp/int8-kv-model', '--prefill', '1', '--decode', '1',
        '--node-arg=--num-kv-blocks=600', f'--node-arg=--kv-cache-dtype={dtype}', '--ready-timeout-s', '300'],
        stdout=subprocess.PIPE, stderr=open(log, 'w'), text=True)
    metrics = {}
    for line in p.stdout:
        m = re.search(r'^(\S+) grpc=.*metrics=(\S+)', line)
        if m: metrics[m.group(1)] = m.group(2)
        if line.startswith('Fission is up: '):
            return p, line.split(': ', 1)[1].strip(), metrics
    raise SystemExit('no cluster ' + dtype)

def metric(url, name):
    txt = urllib.request.urlopen(url).read().decode()
    return sum(float(l.split()[-1]) for l in txt.splitlines() if l.startswith(name) and not l.startswith('#'))

def ttft(url, text):
    body = json.dumps({'inputs': text, 'parameters': {'max_new_tokens': 2, 'details': True}}).encode()
    req = urllib.request.Request(url + '/generate_stream', body, {'Content-Type': 'application/json'})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req) as r:
        for line in r:
            if first is None and line.startswith(b'data:'):
                first = time.perf_counter() - t0
    # Read to the end: closing early cancels the request while its KV is still arriving.
    return first

runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
clusters = {d: up(d, f'/tmp/int8/bench/{d}.log') for d in ['int8', 'bf16']}
time.sleep(3)
res = {d: [] for d in clusters}
bytes_per_tok = {d: [] for d in clusters}
n_tokens = None
for i in range(runs + 1):
    order = ['int8', 'bf16'] if i % 2 == 0 else ['bf16', 'int8']
    for d in order:
        p, url, m = clusters[d]
        text, _ = prompt(1000 * i + (0 if d == 'int8' else 1))
        before = metric(m['decode-0'], 'fission_decode_kv_received_bytes_total')
        t = ttft(url, text)
        # Wait until the counter stops moving: the last layers may land after the first token.
        after, prev = None, -1
        while after != prev:
            prev = after
            time.sleep(0.3)
            after = metric(m['decode-0'], 'fission_decode_kv_received_bytes_total')
        if i == 0:
            continue  # warm-up
        res[d].append(t)
        bytes_per_tok[d].append((after - before) / 2048)
for d in res:
    xs = res[d]
    print(f'{d}: TTFT median {statistics.median(xs)*1000:.0f} ms, min {min(xs)*1000:.0f}, max {max(xs)*1000:.0f}, runs {[round(x*1000) for x in xs]}; pushed bytes/token {bytes_per_tok[d]}')
print('ratio int8/bf16 of medians', statistics.median(res['int8']) / statistics.median(res['bf16']))
for p, _, _ in clusters.values():
    p.terminate()
for p, _, _ in clusters.values():
    p.wait(timeout=60)
