# frozen_string_literal: true

# The 2009 Rails benchmark's app (bench/rails.rb): see app.rb.
require_relative "app"

rails = Rails.application
# GET /_bench/gc: this process's GC counters as "allocated gc_ms major minor\n", read by
# bench/rails.rb before and after a measured window (allocations per request). Outside
# Rails, so that it costs the measured requests nothing; the same for every server.
run(lambda do |env|
  next rails.call(env) unless env["PATH_INFO"] == "/_bench/gc"

  gc = GC.stat
  body = "#{gc[:total_allocated_objects]} #{gc[:time] || -1} #{gc[:major_gc_count]} #{gc[:minor_gc_count]}\n"
  [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]
end)
