# second call of GPU session 5: where ours goes on the GPU on the trained backbone's outputs
set -u
python3 - <<'PY'
import torch, utils
f = torch.load(".gpu/feat_eu_train/trained_backbone_features.pt", weights_only=True)
for k in (100, 500, 3000):
    torch.save(utils.fresh_head_outputs(f, k, 0).contiguous(), f"/tmp/tb_{k}.pt")
PY
for k in 500 100 3000; do
  timeout 70 python3 profile_labeler.py --device cuda --input /tmp/tb_$k.pt --phases --repeat 3 \
      --out $OUT/labeler_phases_gpu_trained_backbone_$k.txt 2>&1 | tail -22
done
timeout 50 python3 profile_labeler.py --device cuda --input .gpu/feat_eu_train/trained_net_outputs.pt \
    --phases --repeat 3 --out $OUT/labeler_phases_gpu_trained_net_128.txt 2>&1 | tail -22
timeout 60 python3 profile_labeler.py --device cuda --input /tmp/tb_500.pt --repeat 3 \
    --out $OUT/labeler_profile_gpu_trained_backbone_500.txt 2>&1 | tail -5
