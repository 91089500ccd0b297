// quiet.go: autovacuum around the measured runs. A latency run measures one system at 20 or
// 200 messages a second for up to a minute, and its p99 at 20/s is the 12th slowest of 1,200
// messages: one autovacuum worker that wakes up in the middle of it, on any database of the
// cluster (River's and Graphile Worker's tables are left with hundreds of thousands of dead
// rows by the backlog workloads before), takes one of the machine's two cores for seconds and
// puts its mark on whichever system happens to run then. So before each latency run every
// benchmark database is vacuumed and analyzed and the run waits for autovacuum to be idle, and during the
// run a sampler records whether an autovacuum worker was busy, which the report shows beside
// the tails. The throughput runs (W1, W1b, W4, W4f, W4w, W5b, W5, W2) are quiesced and sampled alike:
// a worker's CPU is counted to whichever system runs then (every PostgreSQL process is), and
// in one W1 with every system a worker vacuumed River's or Graphile Worker's table, left by
// their own runs, during 8 of the 32 runs.
//
// And the machine's own reclaim: this kind of virtual machine runs DAMON (the kernel's Data
// Access MONitor) with a pageout scheme, whose thread kdamond takes one of the two vCPUs for
// 25-43 ms at a time, about 1.3 % of a CPU in all (perf sched timehist over a W3 run: 201
// runs, 938 ms in 70 s). Every process that wakes meanwhile queues for the other vCPU: in
// that run 95 wake-ups waited more than 1 ms, the benchmark's own producer and listener
// among them, and the slowest messages were those. W3 at 20/s with kdamond stopped, two
// rounds of pepsi and the raw loop: done p99 3.87 and 2.97 ms against 3.71-5.57 ms with it
// running. It is the machine's, not any system's, and a burst in a backlog run of two seconds
// takes a few per cent from whichever system runs then, so by default (-pause-damon) the
// benchmark stops it for the whole run and starts it again at the end; W3 at 20/s then runs
// once more for pepsi and the raw loop with it running ("W3d"), so that the report shows
// both, and each latency run records kdamond's CPU time.
package main

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"pepsi-dispatch/internal/damon"
)

// kdamondMS is the CPU time of the kdamond threads so far, in ms.
func kdamondMS() float64 { return float64(damon.CPUTicks() * msPerTick) }

// quietTimeout bounds the wait for autovacuum to finish before a measured run: past it the run
// starts anyway (the sampler then shows the worker in the report).
const quietTimeout = 2 * time.Minute

// quiesce vacuums and analyzes every system's database (so that autovacuum finds nothing to do
// in the next minutes) and waits until no autovacuum worker runs.
func (b *bench) quiesce(ctx context.Context) {
	seen := map[string]bool{}
	for _, s := range append(slices.Clip(b.systems), b.besides...) {
		if s.pool == nil || seen[s.dbname] {
			continue
		}
		seen[s.dbname] = true
		// The whole database: River's and Graphile Worker's schemas have more than the
		// queue table (leaders, queues, known crontabs) that their runs churned too. ANALYZE
		// as well: autovacuum analyzes a table after enough changes since its last ANALYZE,
		// which a plain VACUUM does not reset (in a full run, an autovacuum ANALYZE of
		// river_job ran during pepsi's W3 at 20/s after a plain VACUUM).
		if _, err := s.pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
			logf("  vacuum %s before a measured run: %v", s.dbname, err)
		}
	}
	deadline := time.Now().Add(quietTimeout)
	for {
		n := len(b.autovacuumWorkers(ctx))
		if n == 0 {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			logf("  %d autovacuum worker(s) still running after %s: the run starts anyway", n, quietTimeout)
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// autovacuumWorkers returns what the autovacuum workers running do, one entry each
// (pg_stat_activity's query: "autovacuum: VACUUM public.river_job").
func (b *bench) autovacuumWorkers(ctx context.Context) []string {
	rows, err := b.pg.admin.Query(ctx,
		`SELECT coalesce(datname, '') || ': ' || coalesce(query, '') FROM pg_stat_activity
		  WHERE backend_type = 'autovacuum worker'`)
	if err != nil {
		if ctx.Err() == nil {
			logf("  read autovacuum workers: %v", err)
		}
		return nil
	}
	defer rows.Close()
	var what []string
	for rows.Next() {
		var q string
		if rows.Scan(&q) == nil {
			what = append(what, strings.TrimPrefix(q, "autovacuum: "))
		}
	}
	if err := rows.Err(); err != nil && ctx.Err() == nil {
		logf("  read autovacuum workers: %v", err)
	}
	return what
}

// avSampler watches autovacuum during a measured run: every avSampleEvery it asks once (a
// query on the admin connection: the same small load for every system).
type avSampler struct {
	stop    context.CancelFunc
	wg      sync.WaitGroup
	samples int
	busy    int             // samples with at least one worker
	tables  map[string]bool // what the workers vacuumed
}

const avSampleEvery = 250 * time.Millisecond

func (b *bench) sampleAutovacuum(ctx context.Context) *avSampler {
	ctx, cancel := context.WithCancel(ctx)
	a := &avSampler{stop: cancel, tables: map[string]bool{}}
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		t := time.NewTicker(avSampleEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			what := b.autovacuumWorkers(ctx)
			if ctx.Err() != nil {
				return
			}
			a.samples++
			if len(what) > 0 {
				a.busy++
			}
			for _, w := range what {
				a.tables[w] = true
			}
		}
	}()
	return a
}

// finish stops the sampler and returns the share of samples with an autovacuum worker busy
// (%) and what the workers vacuumed.
func (a *avSampler) finish() (float64, []string) {
	a.stop()
	a.wg.Wait()
	var what []string
	for w := range a.tables {
		what = append(what, w)
	}
	slices.Sort(what) // the report's order, not the map's
	if a.samples == 0 {
		return 0, what
	}
	return 100 * float64(a.busy) / float64(a.samples), what
}
