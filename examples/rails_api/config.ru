# frozen_string_literal: true

# A minimal Rails API on NeverBlock: notes in PostgreSQL through the
# neverblock_postgresql adapter, and an endpoint that spends a second in the
# database, to show one process answering many such requests at once.
# README.md (next to this file) has the whole story; in short, from a
# checkout of NeverBlock after bin/setup, with a PostgreSQL that libpq's
# PG* variables reach (PGHOST, PGUSER, PGPASSWORD; PGDATABASE, default rails_api):
#
#   export BUNDLE_PATH=vendor/bundle
#   (cd examples/rails_api && bundle exec bin/rails db:prepare)
#   bundle exec exe/neverblock serve examples/rails_api/config.ru -p 3000
#   curl -s -H 'content-type: application/json' -d '{"title":"hello"}' http://127.0.0.1:3000/notes
#   curl -s http://127.0.0.1:3000/notes
#   seq 10 | xargs -P 10 -I{} curl -s http://127.0.0.1:3000/slow   # ten 1 s queries: about 1 s

require_relative "config/environment"

run Rails.application
