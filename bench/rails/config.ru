# frozen_string_literal: true

# The 2009 Rails benchmark's app (bench/rails.rb): see app.rb.
require_relative "app"

run Rails.application
