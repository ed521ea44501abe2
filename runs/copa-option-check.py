import sys, capt, torch
from capt.tasks import Rendered
bb = capt.load_backbone(sys.argv[1]); task = capt.get_task("copa")
ex = capt.load_examples(task, "val")
rs = [task.render(e, bb.style) for e in ex]
right = 0
with torch.no_grad():
    for i in range(0, len(rs), 10):
        b = [Rendered(r.head_prompt, (" 1", " 2"), r.label) for r in rs[i:i+10]]
        p = capt.score(bb, None, b).logits.argmax(1).tolist()
        right += sum(int(a == r.label) for a, r in zip(p, b))
print(sys.argv[1], "option-number zero-shot on the head text:", right, "/", len(rs))
