// Command stage is the benchmark's no-op stage program, built with pepsi's stage SDK: every
// message is advanced to the stage's first NEXT stage, or finished (Done) at a final stage.
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
	next := strings.Fields(os.Getenv("PEPSI_NEXT"))
	stamp := os.Getenv("BENCH_STAMP") == "1"
	stage.Run(func(_ context.Context, m *stage.Message) error {
		if stamp {
			if m.State == nil {
				m.State = map[string]any{}
			}
			if _, ok := m.State["t0"]; !ok {
				m.State["t0"] = time.Now().UnixNano()
			}
		}
		if len(next) > 0 {
			return m.Advance(next[0])
		}
		return m.Done()
	})
}
