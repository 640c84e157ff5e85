# frozen_string_literal: true

Rails.application.routes.draw do
  resources :notes, only: %i[index show create]
  get "slow", to: "slow#show"
  get "up", to: "rails/health#show"
end
