// systems_python.go: pepsi-python, pepsi-dispatch whose stage program is the no-op stage
// written with the Python SDK (python/pepsi_stage.py, pystage/bench_stage.py). The dispatcher,
// its configuration and the workloads are those of "pepsi"; only the stage program differs,
// so the two side by side compare the SDKs. It runs only when -systems names it.
package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// pythonSystem is the system's name for -systems.
const pythonSystem = "pepsi-python"

// pythonInterpreter runs the Python stage (its #! line): Debian's, which python3-psycopg
// installs for.
const pythonInterpreter = "/usr/bin/python3"

// pythonSystems returns pepsi-python when -systems names it, with its stage program copied
// into tmp/bin (world-readable: workers run as nobody when the benchmark runs as root).
func (b *bench) pythonSystems() ([]*system, error) {
	if b.onlySys == nil || !b.onlySys[pythonSystem] {
		return nil, nil
	}
	if out, err := exec.Command(pythonInterpreter, "-c", "import psycopg").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("%s needs %s with psycopg 3 (apt-get install python3-psycopg): %v\n%s",
			pythonSystem, pythonInterpreter, err, out)
	}
	for _, f := range []struct{ src, dst string }{
		{filepath.Join(b.root, "python", "pepsi_stage.py"), "pepsi_stage.py"},
		{filepath.Join(b.benchDir, "pipeline", "pystage", "bench_stage.py"), "bench-stage.py"},
	} {
		data, err := os.ReadFile(f.src)
		if err != nil {
			return nil, fmt.Errorf("copy the Python stage: %w", err)
		}
		if err := os.WriteFile(filepath.Join(b.bin, f.dst), data, 0o755); err != nil {
			return nil, fmt.Errorf("copy the Python stage: %w", err)
		}
	}
	// The bytecode, compiled once here: a worker that cannot write __pycache__ (nobody, in a
	// directory it does not own) would compile pepsi_stage.py at every start (~60 ms of CPU).
	if out, err := exec.Command(pythonInterpreter, "-m", "py_compile", filepath.Join(b.bin, "pepsi_stage.py")).
		CombinedOutput(); err != nil {
		return nil, fmt.Errorf("compile pepsi_stage.py: %v\n%s", err, out)
	}
	if err := os.Chmod(filepath.Join(b.bin, "__pycache__"), 0o755); err != nil {
		return nil, err
	}
	return []*system{{name: pythonSystem, kind: kindPepsi, label: "pepsi-dispatch, Python SDK",
		dbname: "bench_workqueue"}}, nil
}

// stageProgram is the PROGRAM of s's stages.
func (b *bench) stageProgram(s *system) string {
	if s.name == pythonSystem {
		return filepath.Join(b.bin, "bench-stage.py")
	}
	return filepath.Join(b.bin, "bench-stage")
}

// pythonReport is the report's section comparing the Python SDK with the Go SDK: the
// throughput and the CPU per transition of each workload both ran.
func (b *bench) pythonReport(p func(format string, args ...any)) {
	r := &b.res
	var rows []string
	for _, wl := range []string{"W1", "W2", "W4", "W5"} {
		goS, pyS := r.summary(wl, "pepsi"), r.summary(wl, pythonSystem)
		if pyS.n == 0 {
			continue
		}
		rows = append(rows, fmt.Sprintf("| %s | %s | %s | %s | %.1f | %.1f | %.1f | %.1f |\n", wl,
			f0(goS.rate), f0(pyS.rate), ratio(pyS.rate, goS.rate), goS.cpu1k, pyS.cpu1k, goS.child1k, pyS.child1k))
	}
	if len(rows) == 0 {
		return
	}
	p("## The Python SDK against the Go SDK\n\n")
	p("The same dispatcher and configuration; the stage program is the no-op stage written with ")
	p("`python/pepsi_stage.py` (pepsi-python) or with the Go SDK (pepsi). Medians; CPU in ms per 1,000 transitions ")
	p("(all: the system's processes and PostgreSQL; workers: the dispatcher's children).\n\n")
	p("| workload | Go SDK, transitions/s | Python SDK, transitions/s | Python / Go | CPU Go | CPU Python | workers' CPU Go | workers' CPU Python |\n")
	p("|---|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, row := range rows {
		p("%s", row)
	}
	p("\n")
}
