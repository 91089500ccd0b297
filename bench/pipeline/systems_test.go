package main

import (
	"slices"
	"testing"
)

// TestStageParallelism: pepsi's worker budget is divided, not multiplied, by the stages of a
// run, so that W4 runs as many workers as W1 (the bench's fairness rests on it).
func TestStageParallelism(t *testing.T) {
	for _, tc := range []struct {
		workers int
		o       startOpts
		want    []int
	}{
		{8, startOpts{stages: 1}, []int{8}},
		{8, startOpts{stages: 3}, []int{3, 3, 2}},
		{9, startOpts{stages: 3}, []int{3, 3, 3}},
		{2, startOpts{stages: 3}, []int{1, 1, 1}}, // a stage needs one worker to run at all
		{8, startOpts{stages: 3, fuse: true}, []int{8, 1, 1}},
		{8, startOpts{stages: 3, wide: true}, []int{8, 8, 8}},
	} {
		if got := stageParallelism(tc.workers, tc.o); !slices.Equal(got, tc.want) {
			t.Errorf("stageParallelism(%d, %+v) = %v, want %v", tc.workers, tc.o, got, tc.want)
		}
	}
}
