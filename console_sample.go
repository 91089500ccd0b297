// console_sample.go: the figures behind the console's charts, sampled by the daemon.
//
// Every consoleSampleEvery the sampler reads the coordinator's latest published snapshot (the
// per-stage counters of status lines: processed and failed) and one row-count query on the
// pool (pending rows per stage, through the partial indexes of pending rows), and appends one
// point per stage to a ring of consoleSamples points: an hour at 10 s, 360 points of 3
// numbers per stage, about 9 KiB per stage. The sampler is the ring's only writer; the HTTP
// handlers read a copy under the mutex. It never touches the coordinator's connection or state.

package main

import (
	"context"
	"database/sql"
	"fmt"
	"html/template"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
)

const (
	consoleSampleEvery = 10 * time.Second
	consoleSamples     = 360 // one hour of points at consoleSampleEvery
)

// samplePoint is one stage's figures at one moment: rates since the previous point.
type samplePoint struct {
	At      time.Time
	Done    float64 // status lines with status 0 per second
	Failed  float64 // failed status lines per second
	Backlog int64   // pending rows
}

// sampler keeps the last hour of samplePoints per stage.
type sampler struct {
	snap func() *metricsSnapshot // the coordinator's latest snapshot, nil before the first
	pool func() *sql.DB          // nil until the dispatcher's pool exists
	log  *slog.Logger

	mu     sync.Mutex               // guards series and last
	series map[string][]samplePoint // per stage, oldest first, at most consoleSamples
	last   map[string]stageCounters // counters at the previous point
	lastAt time.Time
}

func newSampler(snap func() *metricsSnapshot, pool func() *sql.DB, log *slog.Logger) *sampler {
	return &sampler{snap: snap, pool: pool, log: log,
		series: map[string][]samplePoint{}, last: map[string]stageCounters{}}
}

// sampleLoop samples until ctx ends.
func (s *sampler) sampleLoop(ctx context.Context) {
	t := time.NewTicker(consoleSampleEvery)
	defer t.Stop()
	s.sample(ctx, time.Now())
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			s.sample(ctx, now)
		}
	}
}

// sample takes one point per stage.
func (s *sampler) sample(ctx context.Context, now time.Time) {
	db := s.pool()
	if db == nil {
		return // a standby, or waiting for a writable server: nothing to sample yet
	}
	backlog, err := pendingPerStage(ctx, db)
	if err != nil {
		s.log.Warn("console: backlog not sampled", "err", err)
	}
	snap := s.snap()
	s.mu.Lock()
	defer s.mu.Unlock()
	counters := map[string]stageCounters{}
	if snap != nil {
		for _, st := range snap.stages {
			counters[st.name] = st.c
		}
	}
	names := map[string]bool{}
	for n := range counters {
		names[n] = true
	}
	// Of the stages the dispatcher does not run, those with the biggest backlog, up to
	// strayListMax (strays.go): a series per stage of a producer that writes a stage per
	// tenant would grow by thousands of series every sample.
	unknown := map[string]int64{}
	for n, b := range backlog {
		if _, ok := counters[n]; !ok {
			unknown[n] = b
		}
	}
	top, _ := topStages(unknown, strayListMax)
	for _, n := range top {
		names[n] = true
	}
	dt := now.Sub(s.lastAt).Seconds()
	for name := range names {
		p := samplePoint{At: now, Backlog: backlog[name]}
		if c, ok := counters[name]; ok {
			if old, seen := s.last[name]; seen && dt > 0 && c.Processed >= old.Processed {
				p.Done = float64(c.Processed-old.Processed) / dt
				p.Failed = float64(c.Failed-old.Failed) / dt
			}
			s.last[name] = c
		}
		pts := append(s.series[name], p)
		if len(pts) > consoleSamples {
			pts = slices.Delete(pts, 0, len(pts)-consoleSamples)
		}
		s.series[name] = pts
	}
	// A stage that had no point for the whole window (taken out of the configuration, its
	// backlog gone) has a chart of nothing: its series goes, so that the series are those of
	// the last hour's stages, not of every stage the daemon ever saw.
	for name, pts := range s.series {
		if len(pts) > 0 && now.Sub(pts[len(pts)-1].At) > consoleSamples*consoleSampleEvery {
			delete(s.series, name)
			delete(s.last, name)
		}
	}
	s.lastAt = now
}

// points returns a copy of one stage's series.
func (s *sampler) points(stage string) []samplePoint {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.series[stage])
}

// pendingPerStageSQL counts pending rows per stage, one index-only walk of each partial index
// of pending rows: workqueue_pending (status = 'pending' AND NOT key_parked) and
// workqueue_parked (... AND key_parked). Their cost is the backlog's size, never the table's.
// A plain "WHERE status = 'pending'" matches neither index's predicate, so it was a scan of
// the whole table every consoleSampleEvery, done rows and all, whether anyone looked at the
// console or not (360 ms, in parallel and JIT-compiled, on a table of 4 million done rows;
// TestSamplerPendingByIndex).
const pendingPerStageSQL = `
SELECT stage, count(*) FROM (
    SELECT stage FROM workqueue WHERE status = 'pending' AND NOT key_parked
    UNION ALL
    SELECT stage FROM workqueue WHERE status = 'pending' AND key_parked) pending
 GROUP BY stage`

// pendingPerStage counts pending rows per stage (pendingPerStageSQL).
func pendingPerStage(ctx context.Context, db interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}) (map[string]int64, error) {
	ctx, cancel := context.WithTimeout(ctx, consoleStatementTimeout)
	defer cancel()
	rows, err := db.QueryContext(ctx, pendingPerStageSQL)
	if err != nil {
		return nil, fmt.Errorf("count pending rows per stage: %w", err)
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var stage string
		var n int64
		if err := rows.Scan(&stage, &n); err != nil {
			return nil, fmt.Errorf("count pending rows per stage: %w", err)
		}
		out[stage] = n
	}
	return out, rows.Err()
}

// chartSVG draws a stage's series as an inline SVG: done (solid) and failed (dashed) rates on
// the left scale, the backlog as a filled area on its own scale. No script, no external
// resource: it is plain markup, allowed by the console's Content-Security-Policy.
func chartSVG(pts []samplePoint) template.HTML {
	const w, h, pad = 360.0, 90.0, 2.0
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart" viewBox="0 0 %g %g" role="img" aria-label="rate and backlog over the last hour">`, w, h)
	if len(pts) < 2 {
		fmt.Fprintf(&b, `<text x="8" y="%g" class="muted">collecting figures (one point every %s)</text></svg>`, h/2, consoleSampleEvery)
		return template.HTML(b.String())
	}
	maxRate, maxBacklog := 1.0, int64(1)
	for _, p := range pts {
		maxRate = math.Max(maxRate, math.Max(p.Done, p.Failed))
		maxBacklog = max(maxBacklog, p.Backlog)
	}
	// The x axis spans the points there are (up to the hour kept), newest at the right edge,
	// so the first minutes after a start fill the chart instead of its last sliver.
	x := func(i int) float64 { return pad + (w-2*pad)*float64(i)/float64(len(pts)-1) }
	off := 0
	y := func(v, top float64) float64 { return h - pad - (h-2*pad)*v/top }
	line := func(v func(samplePoint) float64, top float64) string {
		var s strings.Builder
		for i, p := range pts {
			fmt.Fprintf(&s, "%.1f,%.1f ", x(off+i), y(v(p), top))
		}
		return s.String()
	}
	area := fmt.Sprintf("%.1f,%.1f ", x(off), h-pad) +
		line(func(p samplePoint) float64 { return float64(p.Backlog) }, float64(maxBacklog)) +
		fmt.Sprintf("%.1f,%.1f", x(off+len(pts)-1), h-pad)
	fmt.Fprintf(&b, `<polygon class="backlog" points="%s"/>`, area)
	fmt.Fprintf(&b, `<polyline class="done" points="%s"/>`, line(func(p samplePoint) float64 { return p.Done }, maxRate))
	fmt.Fprintf(&b, `<polyline class="failed" points="%s"/>`, line(func(p samplePoint) float64 { return p.Failed }, maxRate))
	span := pts[len(pts)-1].At.Sub(pts[0].At).Round(time.Second)
	fmt.Fprintf(&b, `<text x="4" y="12" class="legend">last %s · max %.0f/s · backlog max %d</text></svg>`, span, maxRate, maxBacklog)
	return template.HTML(b.String())
}
