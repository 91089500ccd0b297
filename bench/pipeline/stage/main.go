// Command stage is the benchmark's no-op stage program, built with pepsi's stage SDK: every
// message is advanced to the stage's first NEXT stage, or finished (Done) at a final stage.
// It implements its own stage and every stage PEPSI_FUSE lists (stage fusion: the W4 variant
// with FUSE = yes runs s2 and s3 in the pass of s1); without FUSE it is a one-handler program.
//
// With BENCH_STAMP=1 in its environment (the dispatcher passes its own environment on to its
// workers) it records when the handler first saw the message, as state.t0 = Unix nanoseconds,
// written in the same UPDATE as the outcome, so it costs no extra statement. The latency
// workloads read it back; the throughput workloads leave it off.
package main

import (
	"context"
	"os"
	"strings"
	"time"

	"pepsi-dispatch/stage"
)

func main() {
	// Each stage's NEXT: the served stage's from PEPSI_NEXT, the fused stages' from PEPSI_FUSE
	// (entries STAGE=NEXT1,NEXT2; STAGE= for a final stage).
	next := map[string][]string{os.Getenv("PEPSI_STAGE"): strings.Fields(os.Getenv("PEPSI_NEXT"))}
	for _, e := range strings.Fields(os.Getenv("PEPSI_FUSE")) {
		name, list, _ := strings.Cut(e, "=")
		next[name] = strings.FieldsFunc(list, func(r rune) bool { return r == ',' })
	}
	stamp := os.Getenv("BENCH_STAMP") == "1"
	h := func(_ context.Context, m *stage.Message) error {
		if stamp {
			if m.State == nil {
				m.State = map[string]any{}
			}
			if _, ok := m.State["t0"]; !ok {
				m.State["t0"] = time.Now().UnixNano()
			}
		}
		if n := next[m.Stage]; len(n) > 0 {
			return m.Advance(n[0])
		}
		return m.Done()
	}
	handlers := map[string]stage.Handler{}
	for name := range next {
		handlers[name] = h
	}
	stage.RunStages(handlers)
}
