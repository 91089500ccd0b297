// conf.go: what pepsi-queue reads from the daemon's configuration file: the [database] DSN
// and the names of the file's stages (so that `pause` refuses a misspelt one). The file is
// read with the daemon's rules (internal/conffile, held to the daemon's reader by a fuzz test);
// the values of keys other than the DSN are not checked here.

package main

import (
	"errors"

	"pepsi-dispatch/internal/conffile"
)

type confFile struct {
	path   string
	dsn    string
	stages map[string]bool
	paused map[string]string // a stage's PAUSED in the file, as written
}

// readConf reads path; a missing file returns an empty confFile and an error wrapping
// os.ErrNotExist (PEPSI_DSN may stand in for it). A malformed file is a usage error (exit 2).
func readConf(path string) (*confFile, error) {
	f, err := conffile.Read(path)
	c := &confFile{path: f.Path, dsn: f.DSN, stages: f.Stages, paused: f.Paused}
	var ce *conffile.Error
	if errors.As(err, &ce) {
		return c, &usageError{ce.Error()}
	}
	return c, err
}
