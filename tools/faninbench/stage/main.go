// Command stage is faninbench's stage program, built on the stage SDK. It serves the stage
// named by PEPSI_STAGE:
//
//	split  splits its message: payload {"n": N} into N children at 'child' (Split, one
//	       payload each), or {"n": N, "range": true} into N slices of [1, N] (SplitRange),
//	       continuing at 'join'. It records clock_timestamp() before and after the split in
//	       bench_split, in its own transaction (the row's commit timestamp is the split's).
//	child  a no-op: Done, nothing else (the benchmark reads the commit time of the row).
//	join   records clock_timestamp() at its start in bench_join, then Done.
package main

import (
	"context"
	"encoding/json"
	"fmt"

	"pepsi-dispatch/stage"
)

func main() {
	stage.Run(func(ctx context.Context, m *stage.Message) error {
		switch m.Stage {
		case "child":
			return m.Done()
		case "join":
			if _, err := m.Tx.ExecContext(ctx, `INSERT INTO bench_join (id, started) VALUES ($1, clock_timestamp())`, m.ID); err != nil {
				return err
			}
			return m.Done()
		case "split":
			return split(ctx, m)
		}
		return fmt.Errorf("faninbench stage: unknown stage %q", m.Stage)
	})
}

func split(ctx context.Context, m *stage.Message) error {
	var p struct {
		N     int  `json:"n"`
		Range bool `json:"range"`
	}
	if err := json.Unmarshal(m.Payload, &p); err != nil {
		return fmt.Errorf("decode payload: %w", err)
	}
	if _, err := m.Tx.ExecContext(ctx, `INSERT INTO bench_split (id, n, t0) VALUES ($1, $2, clock_timestamp())`, m.ID, p.N); err != nil {
		return err
	}
	var err error
	if p.Range {
		err = m.SplitRange(ctx, "join", "child", 1, int64(p.N), stage.RangeOpts{MaxChildren: p.N, MinSpan: 1})
	} else {
		payloads := make([]json.RawMessage, p.N)
		for i := range payloads {
			payloads[i] = json.RawMessage(`{}`)
		}
		err = m.Split(ctx, "join", "child", payloads)
	}
	if err != nil {
		return err
	}
	_, err = m.Tx.ExecContext(ctx, `UPDATE bench_split SET t1 = clock_timestamp() WHERE id = $1`, m.ID)
	return err
}
