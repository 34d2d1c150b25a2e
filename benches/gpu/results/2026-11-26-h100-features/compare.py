import json,sys
base,cpu=sys.argv[1],sys.argv[2]
def load(p):
    return [json.loads(l) for l in open(p) if '"loss"' in l]
def cmp(a,b,label):
    A,B=load(a),load(b)
    loss=max(abs(x['loss']-y['loss'])/abs(y['loss']) for x,y in zip(A,B))
    aux=max((abs(x.get('aux_loss',0)-y.get('aux_loss',0)) for x,y in zip(A,B)),default=0)
    route=all(x.get('expert_tokens')==y.get('expert_tokens') for x,y in zip(A,B))
    margin=min((x.get('router_margin',1) for x in A),default=1)
    print(f"| {label} | {len(A)} | {loss:.2e} | {aux:.2e} | {route} | {margin:.1e} |")
print("| run | steps | max relative loss difference | max aux-loss difference | same routing | min router margin |")
print("| --- | --- | --- | --- | --- | --- |")
for r in ['tiny-tp2-sp','tiny-cp2']: cmp(base+r+'/metrics.jsonl',base+'tiny-1/metrics.jsonl',r+' vs CUDA 1 rank')
for r in ['moe-ep2','moe-ep2-tp2-sp']: cmp(base+r+'/metrics.jsonl',base+'moe-1/metrics.jsonl',r+' vs CUDA 1 rank')
cmp(base+'moe-1-bf16/metrics.jsonl',base+'moe-1/metrics.jsonl','moe-1-bf16 vs CUDA fp32')
for r in ['tiny-1','moe-1','moe-1-bf16','moe-ep2-tp2-sp']:
    try: cmp(base+r+'/metrics.jsonl',cpu+r+'/metrics.jsonl',r+' CUDA vs CPU')
    except Exception as e: print(r,e)
