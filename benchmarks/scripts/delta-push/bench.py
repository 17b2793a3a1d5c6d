# A/B of delta pushes (issue 34): two 1P+1D clusters up at once, one linking the decode node's
# cached prefix (--kv-delta=true, the default), one pushing every prompt in full
# (--decode-arg=--kv-delta=false). Each round runs fission-loadtest --workload multi-turn (one
# conversation of 4 turns, closed loop of 1) against both, alternating which goes first, with
# the same seed for both (the same prompts) and a fresh seed per round (no cross-round hits).
# Per turn: TTFT from the loadtest JSON; bytes from fission_decode_kv_received_bytes_total.
import json, re, statistics, subprocess, sys, time, urllib.request

ROOT = '/work/main/target/release'
MODEL = '/tmp/delta-push-model'
WORKLOAD = ['--workload', 'multi-turn', '--users', '1', '--prefix-len', '1024',
            '--input-len', '32', '--output-len', '16', '--concurrency', '1',
            '--max-requests', '4', '--warmup-requests', '0', '--duration', '600s', '--quiet']

def up(name, port, extra):
    log = open(f'/tmp/delta-push-{name}.log', 'w')
    p = subprocess.Popen([f'{ROOT}/fission', 'up', '--port', port, '--model', MODEL, '--prefill', '1',
                          '--decode', '1', '--node-arg=--num-kv-blocks=1024', '--ready-timeout-s', '300'] + extra,
                         stdout=subprocess.PIPE, stderr=log, text=True)
    metrics = {}
    for line in p.stdout:
        m = re.search(r'^(\S+) grpc=.*metrics=(\S+)', line)
        if m: metrics[m.group(1)] = m.group(2)
        if line.startswith('Fission is up: '):
            return p, line.split(': ', 1)[1].strip(), metrics
    raise SystemExit('no cluster ' + name)

def metric(url, name):
    txt = urllib.request.urlopen(url).read().decode()
    return sum(float(l.split()[-1]) for l in txt.splitlines() if l.startswith(name) and not l.startswith('#'))

def conversation(url, metrics, seed, out):
    before = metric(metrics['decode-0'], 'fission_decode_kv_received_bytes_total')
    subprocess.run([f'{ROOT}/fission-loadtest', '--url', url, '--seed', str(seed), '--json', out] + WORKLOAD,
                   check=True, stdout=subprocess.DEVNULL)
    total = metric(metrics['decode-0'], 'fission_decode_kv_received_bytes_total') - before
    reqs = json.load(open(out))['levels'][0]['requests']
    assert all(r['error'] is None for r in reqs), reqs
    reqs.sort(key=lambda r: r['index'])
    return [r['ttft_s'] for r in reqs], [r['prompt_tokens'] or r['input_len'] for r in reqs], total

# bench.py ROUNDS [fission up flags for both clusters, e.g. --node-arg=--kv-same-host-shm=false
# for QUIC between nodes on this host]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
extra = sys.argv[2:]
clusters = {'delta': up('delta', '18961', extra), 'full': up('full', '18962', extra + ['--decode-arg=--kv-delta=false'])}
time.sleep(2)
ttft = {k: [[] for _ in range(4)] for k in clusters}
later_bytes = {k: [] for k in clusters}
for r in range(rounds):
    order = ['delta', 'full'] if r % 2 == 0 else ['full', 'delta']
    for k in order:
        _, url, metrics = clusters[k]
        t, tokens, total = conversation(url, metrics, 1000 + r, f'/tmp/delta-push-{k}-{r}.json')
        for i in range(4):
            ttft[k][i].append(t[i])
        if k == 'full':
            per_block = total / sum(-(-n // 16) for n in tokens)
        later_bytes[k].append((total, -(-tokens[0] // 16)))
    print(f'round {r}: ' + ', '.join(f'{k} {[round(x[-1]*1e3, 1) for x in ttft[k]]} ms' for k in clusters), flush=True)
res = {}
for k in clusters:
    res[k] = {
        'ttft_ms_by_turn': [[round(x * 1e3, 2) for x in t] for t in ttft[k]],
        'ttft_p50_ms_by_turn': [round(statistics.median(t) * 1e3, 2) for t in ttft[k]],
        'ttft_p50_ms_turns_2_4': round(statistics.median([x for t in ttft[k][1:] for x in t]) * 1e3, 2),
        'bytes_turns_2_4': [total - first * per_block for total, first in later_bytes[k]],
    }
res['per_block_bytes'] = per_block
res['bytes_ratio_turns_2_4'] = statistics.median(res['delta']['bytes_turns_2_4']) / statistics.median(res['full']['bytes_turns_2_4'])
res['ttft_p50_ratio_turns_2_4'] = res['delta']['ttft_p50_ms_turns_2_4'] / res['full']['ttft_p50_ms_turns_2_4']
res['pushes_by_transport'] = {k: [l for l in urllib.request.urlopen(c[2]['prefill-0']).read().decode().splitlines()
                                  if l.startswith('fission_prefill_kv_pushes_total')] for k, c in clusters.items()}
print(json.dumps(res, indent=1))
for p, _, _ in clusters.values():
    p.terminate()
for p, _, _ in clusters.values():
    p.wait(timeout=60)
